"""What bench/bros_be_stall.py and bench/bros_rt_hold.py share: their command line (one `rtbe`
workload on the simulator, a pool and batch shape, a list of policies) and the run of one policy
on it (uncharged virtual time, so whatever a probe counts is deterministic)."""

from __future__ import annotations

import argparse

from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.workloads import load_workload


def probe_parser(doc: str | None, *, num_blocks: int, rate: float, duration: float,
                 policies: str, profile: str, max_batched_tokens: int,
                 max_num_seqs: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-blocks", type=int, default=num_blocks)
    ap.add_argument("--rate", type=float, default=rate, help="RT requests per second")
    ap.add_argument("--duration", type=float, default=duration, help="seconds of arrivals")
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--policies", default=policies, help="comma-separated policy names")
    ap.add_argument("--profile", default=profile)
    ap.add_argument("--max-batched-tokens", type=int, default=max_batched_tokens)
    ap.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    return ap


def run_policy(policy: str, args: argparse.Namespace):
    """The run's metrics (`shunter.benchmark` `Metrics`) for `policy` on the probe's workload."""
    config = EngineConfig(backend="sim", profile=args.profile, num_blocks=args.num_blocks,
                          max_batched_tokens=args.max_batched_tokens,
                          max_num_seqs=args.max_num_seqs, max_queued_requests=100_000)
    w = load_workload(f"rtbe:rate={args.rate},duration={args.duration:g},seed={args.seed}")
    return run_one(parse_policy(policy), w, config, progress=False,
                   clock_limit_s=20 * w.duration_s).metrics
