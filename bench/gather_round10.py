"""BROS's slot copies as gathers (round 10): `bros` with its slot copies run by run (one call per
run of consecutive slots, one transfer per change: the code before this round) against `bros`
with each step's copies batched by direction and each batch's runs gathered into one call
(gpu/slot_copy.py, engine/memory/slot_batches.py), the gather charged `GATHER_CALLS` copy calls
(sim/copy_costs.py) and, for the sensitivity, half and twice that; the same `rtbe` arrivals,
through `shunter bench`'s own runner, on the simulator with scheduler time not charged.

Per run: copy calls (out, in), gathers, transfers, slots per direction, the copy engine's busy
seconds (both directions added), the table fit's wall time per call (`fit`: where the
batching runs; wall clock, so only a ratio within one run means anything), the step's stall on copies, the time the steps' own copies (inputs in, tokens out) waited
behind slot copies on the copy engine (FastSwitch §3.2's bounded dispatch, sim/copy_engine.py),
and the RT/BE metrics.

    python bench/gather_round10.py --points 1500:10,1750:12,3500:13 --seeds 9 --json OUT
    python bench/gather_round10.py --report OUT...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bros_bicache_counts import args_or_report  # noqa: E402
from engine import bidirectional_step  # noqa: E402
from shunter import EngineConfig  # noqa: E402
from shunter.benchmark.policies import parse_policy  # noqa: E402
from shunter.benchmark.run import run_one  # noqa: E402
from shunter.commands.bench import finite  # noqa: E402
from engine import scheduler_stats  # noqa: E402
from shunter.workloads import load_workload  # noqa: E402
from sim import copy_engine, swap  # noqa: E402
from sim.copy_costs import GATHER_CALLS  # noqa: E402

KINDS = {"runs": None, "gather": GATHER_CALLS, "gather_x0.5": GATHER_CALLS / 2,
         "gather_x2": GATHER_CALLS * 2}
"""Copy kind -> a gather's cost in copy calls (None: run by run, no batching)."""
STATE: dict[str, Any] = {"kind": "gather", "busy_s": 0.0, "fit_s": 0.0, "fits": 0,
                         "swappers": [], "tables": [], "fixed_charge_s": None}


def fix_charge(seconds: float) -> None:
    """Charge every iteration `seconds` of scheduler time instead of its measured CPU time (the
    scheduler sleeps `last_scheduler_s` on the virtual clock before it sends the step): the
    mechanism without the host's load. The measured time is still logged (`scheduler_ms_mean`)."""
    record = scheduler_stats.SchedulerStats.record_iteration

    def fixed(self: Any, **kwargs: Any) -> None:
        record(self, **kwargs)
        self.last_scheduler_s = seconds

    STATE["fixed_charge_s"] = seconds
    scheduler_stats.SchedulerStats.record_iteration = fixed  # type: ignore[method-assign]


def install() -> None:
    bidi_init, swap_init = bidirectional_step.BidirectionalMemory.__init__, swap.SimSwapper.__init__
    submit, fit = copy_engine.CopyEngine.submit, bidirectional_step.BidirectionalMemory.fit

    def bidi(self: Any, *args: Any, **kwargs: Any) -> None:
        bidi_init(self, *args, **kwargs, gather=KINDS[STATE["kind"]] is not None)
        STATE["tables"].append(self)

    def swapper(self: Any, *args: Any, **kwargs: Any) -> None:
        swap_init(self, *args, **kwargs, slot_gather_calls=KINDS[STATE["kind"]])
        STATE["swappers"].append(self)

    def busy(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = submit(self, *args, **kwargs)
        STATE["busy_s"] += t.end - t.start
        return t

    def timed_fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return fit(self, *args, **kwargs)
        finally:
            STATE["fit_s"] += time.perf_counter() - began
            STATE["fits"] += 1

    bidirectional_step.BidirectionalMemory.fit = timed_fit  # type: ignore[method-assign]
    bidirectional_step.BidirectionalMemory.__init__ = bidi  # type: ignore[method-assign]
    swap.SimSwapper.__init__ = swapper  # type: ignore[method-assign]
    copy_engine.CopyEngine.submit = busy  # type: ignore[method-assign]


def run(kind: str, spec: str, config: EngineConfig) -> dict[str, Any]:
    STATE.update(kind=kind, busy_s=0.0, fit_s=0.0, fits=0, swappers=[], tables=[])
    workload = load_workload(spec)
    o = run_one(parse_policy("bros"), workload, config, progress=False,
                clock_limit_s=20 * workload.duration_s)
    if o.metrics is None:
        return {"kind": kind, "error": o.error}
    m = o.metrics
    rt, be = m.by_class.get("rt", {}), m.by_class.get("be", {})
    a = rt.get("slo_attainment", {})
    sw, mem = STATE["swappers"][-1], STATE["tables"][-1]
    t = mem.table
    return {"kind": kind, "gather_calls": KINDS[kind],
            "copy_calls": m.swap.copy_ops, "copy_calls_in": m.swap.copy_ops_in,
            "gathers": sw.gathers, "transfers": sw.transfers, "slots": dict(sw.slots),
            "copy_busy_s": round(STATE["busy_s"], 3), "stall_s": round(m.swap.stall_s, 3),
            "step_copy_wait_s": round(m.swap.step_copy_wait_s, 3),
            "checkpointed_slots": t.checkpointed_slots_total,
            "rt_ttft_ok": a.get("ttft"), "rt_tpot_ok_per_token": a.get("tpot_per_token"),
            "rt_ttft_p99_ms": rt["ttft_ms"]["p99"],
            "rt_norm_latency_ms": rt["normalized_latency_ms"]["mean"],
            "be_requests_per_s": be.get("requests_per_s", 0.0),
            "preemptions": m.preemptions, "completed": m.completed, "failed": m.failed,
            "end_requests": len(t.requests()), "end_free_blocks": t.num_free,
            "total_blocks": t.num_total, "wall_s": round(o.wall_s, 1),
            "fit_ms_per_call": round(1000 * STATE["fit_s"] / max(STATE["fits"], 1), 4),
            "charged": config.charge_scheduler_time, "fixed_charge_s": STATE["fixed_charge_s"],
            "scheduler_share": m.scheduler_share,
            "scheduler_ms_mean": m.scheduler_ms_per_iteration.mean, "iterations": m.iterations}


def report(paths: list[Path]) -> str:
    rows = [r for p in paths for r in json.loads(p.read_text())]
    out = ["| blocks / RT/s | seed | copies | copy calls (in) | gathers | transfers | copy busy s "
           "| stall s | step copy wait s | RT TTFT ok | RT norm. latency ms | RT TTFT p99 ms | BE req/s "
           "| preemptions | completed, failed |", "|---" * 15 + "|"]
    for r in rows:
        out.append(" | ".join([
            f"| {r['num_blocks']:,} / {r['rate']:g}", str(r["seed"]), r["kind"],
            f"{r['copy_calls']:,} ({r['copy_calls_in']:,})", f"{r['gathers']:,}",
            f"{r['transfers']:,}", f"{r['copy_busy_s']:.2f}", f"{r['stall_s']:.2f}",
            f"{r['step_copy_wait_s']:.2f}",
            f"{100 * r['rt_ttft_ok']:.1f}%", f"{r['rt_norm_latency_ms']:.1f}",
            f"{r['rt_ttft_p99_ms']:.0f}", f"{r['be_requests_per_s']:.2f}",
            f"{r['preemptions']:,}", f"{r['completed']:,}, {r['failed']}"]) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    point_args(ap)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--charged", action="store_true",
                    help="charge the scheduler's measured CPU time to the virtual clock (its "
                         "share then moves with the host's load: compare interleaved pairs)")
    ap.add_argument("--fixed-charge-ms", type=float, default=None,
                    help="with --charged: charge this many ms per iteration instead of the "
                         "measured CPU time (deterministic)")
    if (args := args_or_report(ap, report)) is None:
        return 0
    install()
    if args.fixed_charge_ms is not None:
        if not args.charged:
            ap.error("--fixed-charge-ms needs --charged")
        fix_charge(args.fixed_charge_ms / 1000)
    sweep(args, args.kinds.split(","), run, charge_scheduler_time=args.charged)
    return 0


def point_args(ap: argparse.ArgumentParser) -> None:
    """The rows both gather scripts sweep: pool and RT rate points, seeds, length, profile."""
    ap.add_argument("--points", default="1500:10,1750:12,3500:13", help="blocks:RT rate, ...")
    ap.add_argument("--seeds", default="9")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--profile", default="llama3-8b-a100")


def sweep(args: argparse.Namespace, variants: list[str],
          run: Callable[[str, str, EngineConfig], dict[str, Any]], **config: Any) -> None:
    """Every variant on each point and seed, the same arrivals for each; a JSON line per run,
    the rows so far rewritten to `args.json` after each."""
    out: list[dict[str, Any]] = []
    for point in args.points.split(","):
        blocks, rate = int(point.split(":")[0]), float(point.split(":")[1])
        engine = EngineConfig(backend="sim", profile=args.profile, num_blocks=blocks,
                              block_size=16, max_batched_tokens=2048, max_num_seqs=256,
                              max_queued_requests=100_000, **config)
        for seed in args.seeds.split(","):
            spec = f"rtbe:rate={rate},duration={args.duration:g},seed={seed}"
            for variant in variants:
                row = {"num_blocks": blocks, "rate": rate, "seed": int(seed), "spec": spec,
                       **run(variant, spec, engine)}
                out.append(row)
                print(json.dumps(finite(row)), flush=True)
                if args.json:
                    args.json.write_text(json.dumps(finite(out), indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
