"""Options shared by the commands that start an engine."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.config import EngineConfig
from policies import policy_dir


def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", type=Path, default=None,
                   help="Hugging Face-format model directory (default: the shipped model)")
    g.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks in the device pool; small values force preemption")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per iteration")
    g.add_argument("--max-batched-tokens", type=int, default=512, help="token budget per iteration")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--async-backend", default="asyncio", choices=("asyncio", "trio"),
                   help="event loop to run the engine on")
    g.add_argument("--cpu-swap-blocks", type=int, default=None,
                   help="host KV blocks for swapping and CPU copies kept across turns "
                        "(default: as many as the device pool; 0: no swapping)")
    g.add_argument("--policy", type=Path, default=None, metavar="FILE",
                   help="scheduling policy file, or the name of a shipped one such as "
                        "fastswitch_markov (default: policies/fcfs.policy)")


def resolve_policy(path: Path) -> Path:
    """A policy file as given, else a shipped policy of that name."""
    if path.exists() or len(path.parts) > 1 or path.suffix:
        return path
    shipped = policy_dir() / f"{path.name}.policy"
    return shipped if shipped.exists() else path


def engine_config(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    fields: dict[str, object] = dict(
        block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens, device=args.device, dtype=args.dtype,
        threads=args.threads, cpu_swap_blocks=getattr(args, "cpu_swap_blocks", None),
    )
    if args.model is not None:
        fields["model"] = args.model
    if getattr(args, "policy", None) is not None:
        fields["policy"] = resolve_policy(args.policy)
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]
