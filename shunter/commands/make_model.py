"""`shunter make-model`: write a random-weight model in Hugging Face format."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.errors import ConfigError
from shunter.commands.common import positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a random-weight Llama or Qwen2 model (HF format)",
                       description="Write config.json, model.safetensors and tokenizer.json for a "
                                   "model with random weights, for tests and experiments.")
    p.add_argument("--arch", choices=("llama", "qwen2"), required=True, help="model family")
    p.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers")
    p.add_argument("--hidden", type=positive_int, default=64, help="hidden size")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=positive_int, default=2,
                   help="key/value heads (grouped-query attention)")
    p.add_argument("--vocab", type=positive_int, default=512, help="vocabulary size (at least 259)")
    p.add_argument("--intermediate", type=positive_int, default=None, help="MLP width (default: about 2.7x hidden)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="weight dtype")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--force", action="store_true",
                   help="write into --out even when it is not empty (its model files are replaced)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gpu.make_model import write_random_model

    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out}: is a file, not a directory")
    if args.out.is_dir() and any(args.out.iterdir()) and not args.force:
        raise ConfigError(f"--out {args.out}: the directory is not empty (--force writes into it)")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {args.out}: cannot create the directory: {exc.strerror}") from None
    out = write_random_model(args.out, arch=args.arch, layers=args.layers, hidden=args.hidden,
                             heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab,
                             seed=args.seed, intermediate=args.intermediate, dtype=args.dtype)
    print(f"wrote {args.arch} model to {out}")
    return 0
