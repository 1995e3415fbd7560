"""`shunter make-model`: write a random-weight model in Hugging Face format."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a random-weight Llama or Qwen2 model (HF format)",
                       description="Write config.json, model.safetensors and tokenizer.json for a "
                                   "model with random weights, for tests and experiments.")
    p.add_argument("--arch", choices=("llama", "qwen2"), required=True)
    p.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default: about 2.7x hidden)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gpu.make_model import write_random_model

    out = write_random_model(args.out, arch=args.arch, layers=args.layers, hidden=args.hidden,
                             heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab,
                             seed=args.seed, intermediate=args.intermediate, dtype=args.dtype)
    print(f"wrote {args.arch} model to {out}")
    return 0
