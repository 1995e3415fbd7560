"""What the KunServe simulator benches share: a trace window from the command line (`--trace
--start --duration --rate --lengths`), its arrivals, and the cluster's per-instance engine
settings (the simulator, vLLM's 256 sequences and 2,048 batched tokens, host swap space)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.config import EngineConfig
from shunter.workloads import load_workload

ROOT = Path(__file__).resolve().parents[1]


def add_trace_args(ap: argparse.ArgumentParser, *, trace: str = "azure-conv",
                   start: float = 1560.0, duration: float = 90.0, rate: str = "1x",
                   traces: list[str] | None = None) -> None:
    ap.add_argument("--trace", default=trace, choices=traces)
    ap.add_argument("--start", type=float, default=start)
    ap.add_argument("--duration", type=float, default=duration)
    ap.add_argument("--rate", default=rate)
    ap.add_argument("--lengths", default="",
                    help="more workload keys, e.g. scale_lengths=5,max_input=12000 (LongBench-"
                         "like prompts on the trace's arrivals)")


def trace_workload(args: argparse.Namespace):
    """(its spec, the workload): the window of the shared trace the arguments name (seed 0:
    every run the same)."""
    spec = f"{args.trace}:start={args.start},duration={args.duration},rate={args.rate}"
    if args.lengths:
        spec += f",{args.lengths}"
    return spec, load_workload(spec, traces_dir=ROOT.parent / "shared" / "traces", seed=0)


def sim_instance(profile: str = "llama3-8b-a10", num_blocks: int | None = None) -> EngineConfig:
    """One instance of the cluster (`num_blocks`: None = what the profile's GPU leaves)."""
    return EngineConfig(backend="sim", profile=profile, cpu_swap_blocks=8192, max_num_seqs=256,
                        max_batched_tokens=2048, num_blocks=num_blocks)


def policy_dir(out: Path) -> Path:
    """Where a bench writes the policy files of its variants (beside its results)."""
    path = out.parent / "kunserve_policies"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_row(label: str, policy_file: Path, workload, base: EngineConfig,
            instances: int = 4) -> dict:
    """One cluster run as a row of the variant benches: P50/P99 TTFT and TPOT, the monitor's
    groups and restores as [seconds from the start, event, members], the run's wall time and
    the commit its code is (`bench.kunserve.code_version`)."""
    import bench.kunserve as bench  # (it imports this module)

    result, cluster, _, wall = bench.run(label, policy_file, workload, base, instances)
    s = bench.summarize(result, None)
    events = [[round(e["t"] - result.started, 1), e["event"], e["members"]]
              for e in (cluster or {}).get("events", [])]
    return {k: s[k] for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms")} | {
        "events": events, "wall_s": wall, "code": bench.code_version()}


def merge_report(old: dict, new: dict) -> dict:
    """`new`'s runs into `old` (a bench/kunserve.py report re-run in part, `--merge`): the runs
    in `old`'s order, each replaced where `new` has it, `new`'s others after; `new`'s top-level
    fields over `old`'s, `old`'s kept where `new` lacks them (the demand, when vllm_dp was not
    re-run)."""
    runs = {k: new["runs"].get(k, v) for k, v in old["runs"].items()} | new["runs"]
    return old | {k: v for k, v in new.items() if k != "runs"} | {"runs": runs}
