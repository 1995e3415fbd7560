"""Options shared by the commands that start an engine."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import ConfigError
from policies import find_policy


def positive_int(text: str) -> int:
    """An argparse type: an integer above 0."""
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer, 0 or above."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", type=Path, default=None,
                   help="Hugging Face-format model directory (default: the shipped model)")
    g.add_argument("--num-blocks", type=positive_int, default=None,
                   help="KV blocks in the device pool; small values force preemption")
    add_step_options(g)
    g.add_argument("--async-backend", default="asyncio", choices=("asyncio", "trio"),
                   help="event loop to run the engine on")
    g.add_argument("--cpu-swap-blocks", type=non_negative_int, default=None,
                   help="host KV blocks for swapping and CPU copies kept across turns "
                        "(default: as many as the device pool; 0: no swapping)")
    g.add_argument("--policy", default=None, metavar="FILE|NAME",
                   help="scheduling policy file, or the name of a shipped one such as "
                        "fastswitch_markov (default: policies/fcfs.policy)")


def add_step_options(g: argparse._ArgumentGroup) -> None:
    """The options every command that starts an engine shares with `shunter bench`: the shape
    of a step and where it runs."""
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=positive_int, default=64, help="most sequences per iteration")
    g.add_argument("--max-batched-tokens", type=positive_int, default=512, help="token budget per iteration")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weight and KV dtype (auto: float32 on CPU, the model's own on CUDA)")
    g.add_argument("--cost-profile", type=Path, default=None, metavar="FILE",
                   help="torch backend: a profile from `shunter profile fit` on this machine, "
                        "whose cost model the policies predict with (default: fitted online)")
    g.add_argument("--cost-correction", type=int, default=None, metavar="N",
                   help="torch backend: scale the cost model's predictions by the median "
                        "measured/predicted ratio of the last N steps per phase (default 8; "
                        "0: off)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads, fixed (default on CPU: chosen while serving from "
                        "the steps' own times, one per core or fewer when other work takes a "
                        "core)")


def resolve_policy(spec: str) -> Path:
    """`--policy`: a policy file as given, else a shipped policy of that name."""
    return find_policy(spec, "--policy")


def engine_config(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    fields: dict[str, object] = dict(
        block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens, device=args.device, dtype=args.dtype,
        threads=args.threads, cpu_swap_blocks=getattr(args, "cpu_swap_blocks", None),
    )
    if getattr(args, "cost_profile", None) is not None:
        fields["cost_profile"] = str(args.cost_profile)
    if getattr(args, "cost_correction", None) is not None:
        fields["cost_correction"] = args.cost_correction
    if args.model is not None:
        if not args.model.is_dir():
            raise ConfigError(f"--model {args.model}: no such directory")
        fields["model"] = args.model
    if getattr(args, "policy", None) is not None:
        fields["policy"] = resolve_policy(args.policy)
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]
