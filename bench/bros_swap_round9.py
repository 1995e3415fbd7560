"""BROS §5.2's extreme case by swap (issue 14, item 6), round 9: `bros` preempting whole requests
by swap into its table's copy space (bench/bros_swap.policy) against `bros` (recompute),
`bros_no_bicache` with swaps in block groups (bench/bros_swap_no_bicache.policy) and `fcfs`, on
the same `rtbe` arrivals; the simulator, scheduler time not charged (virtual time).

Per run, beside the bench metrics: whole-request preemptions ended by swap or by recompute
(with the computed tokens they held), the bidirectional table's own extreme-case swap-outs,
copy calls and bytes, the table's copies by kind (`KINDS`: calls and slots), completed and failed
requests, and the table once the run is over.

    python bench/bros_swap_round9.py --points 1500:10,1750:12,3500:13 --seeds 9,1,2,3 \\
        --policies bros,bench/bros_swap.policy --json OUT
    python bench/bros_swap_round9.py --report OUT...
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bros_bicache_counts import args_or_report
from engine import bidirectional_step
from engine.memory.bidirectional import BidirectionalBlocks, SlotCopies
from engine.memory.slot_runs import slot_runs
from engine.request import Request
from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.commands.bench import finite
from shunter.workloads import load_workload

COUNTS: Counter[str] = Counter()
TABLES: list[Any] = []


def install() -> None:
    init, recompute, swapped = (bidirectional_step.BidirectionalMemory.__init__,
                                Request.recompute, Request.swapped_out)

    def made(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        TABLES.append(self)

    def recomputed(self: Request) -> None:
        COUNTS["recomputes"] += 1
        COUNTS["recomputed_tokens"] += self.computed_tokens
        recompute(self)

    def swapped_out(self: Request, blocks: int) -> None:
        COUNTS["swaps"] += 1
        COUNTS["swapped_tokens"] += self.computed_tokens
        swapped(self, blocks)

    bidirectional_step.BidirectionalMemory.__init__ = made  # type: ignore[method-assign]
    count_copies()
    Request.recompute = recomputed  # type: ignore[method-assign]
    Request.swapped_out = swapped_out  # type: ignore[method-assign]


KINDS = {"_write": "checkpoint", "restore": "restore", "swap_out": "swap_out",
         "swap_in": "swap_in"}
"""The table's methods whose copies are counted by kind: calls as the simulator charges them
(`slot_runs` over what each returned) and slots (`_write` returns only checkpoints, and BE
blocks moved off an RT owner, counted as `move`)."""


def count_copies() -> None:
    def counted(kind: str, method: Any) -> Any:
        def wrapper(self: BidirectionalBlocks, *args: Any, **kwargs: Any) -> SlotCopies:
            copies = method(self, *args, **kwargs)
            for part, pairs in (("", copies.out + copies.into), ("move", copies.move)):
                name = part or kind
                COUNTS[f"{name}_calls"] += len(slot_runs(pairs, self.block_size))
                COUNTS[f"{name}_slots"] += len(pairs)
            return copies
        return wrapper

    for method, kind in KINDS.items():
        setattr(BidirectionalBlocks, method, counted(kind, getattr(BidirectionalBlocks, method)))


def run(policy: str, spec: str, config: EngineConfig) -> dict[str, Any]:
    COUNTS.clear()
    TABLES.clear()
    workload = load_workload(spec)
    o = run_one(parse_policy(policy), workload, config, progress=False,
                clock_limit_s=20 * workload.duration_s)
    if o.metrics is None:
        return {"policy": policy, "error": o.error}
    m = o.metrics
    rt, be = m.by_class.get("rt", {}), m.by_class.get("be", {})
    a = rt.get("slo_attainment", {})
    row = {"policy": policy, "rt_ttft_ok": a.get("ttft"), "rt_tpot_ok": a.get("tpot"),
           "rt_tpot_ok_per_token": a.get("tpot_per_token"),
           "rt_ttft_p99_ms": rt["ttft_ms"]["p99"],
           "rt_norm_latency_ms": rt["normalized_latency_ms"]["mean"],
           "be_requests_per_s": be.get("requests_per_s", 0.0),
           "preemptions": m.preemptions, "completed": m.completed, "failed": m.failed,
           "copy_calls": m.swap.copy_ops, "gb_out": m.swap.bytes_out / 1e9,
           "gb_in": m.swap.bytes_in / 1e9, **COUNTS, "wall_s": round(o.wall_s, 1)}
    if TABLES:
        mem = TABLES[-1]
        t = mem.table
        row.update(table_swap_outs=mem.swapped_out - mem.victims_swapped,
                   victim_swap_outs=mem.victims_swapped, end_requests=len(t.requests()),
                   end_free_blocks=t.num_free, total_blocks=t.num_total,
                   end_free_host_slots=t.free_host_slots,
                   end_free_copy_blocks=t.free_copy_blocks,
                   copy_blocks=t._copy_space.num_total if t.has_copy_space else 0)
    return row


def report(paths: list[Path]) -> str:
    """Means over seeds per (blocks, rate, policy), one markdown table."""
    rows: dict[tuple[int, float, str], list[dict[str, Any]]] = {}
    for path in paths:
        for r in json.loads(path.read_text()):
            if r.get("rerun_of_round8") or r.get("superseded") or r.get("count_check"):
                continue  # a re-run of round 8's row, code since changed, or a counting run
            rows.setdefault((r["num_blocks"], r["rate"], r["policy"]), []).append(r)
    out = ["| blocks | RT/s | policy | seeds | RT TTFT ok | RT TPOT ok per request / per token "
           "| RT norm. latency ms | BE req/s | preemptions | by swap (tokens) | by recompute "
           "(tokens) | table's own swap-outs | GB out / in (copy calls) | completed, failed |",
           "|---" * 14 + "|"]

    def mean(rs: list[dict[str, Any]], k: str) -> float:
        return sum(r.get(k) or 0 for r in rs) / len(rs)

    for (nb, rate, policy), rs in sorted(rows.items()):
        out.append(" | ".join([
            f"| {nb:,}", f"{rate:g}", policy.split("/")[-1].replace(".policy", ""),
            ",".join(str(r["seed"]) for r in rs),
            f"{100 * mean(rs, 'rt_ttft_ok'):.1f}%",
            f"{100 * mean(rs, 'rt_tpot_ok'):.1f}% / {100 * mean(rs, 'rt_tpot_ok_per_token'):.1f}%",
            f"{mean(rs, 'rt_norm_latency_ms'):,.0f}", f"{mean(rs, 'be_requests_per_s'):.2f}",
            f"{mean(rs, 'preemptions'):,.0f}",
            f"{mean(rs, 'swaps'):,.0f} ({mean(rs, 'swapped_tokens'):,.0f})",
            f"{mean(rs, 'recomputes'):,.0f} ({mean(rs, 'recomputed_tokens'):,.0f})",
            f"{mean(rs, 'table_swap_outs'):,.0f}" if "table_swap_outs" in rs[0] else "-",
            f"{mean(rs, 'gb_out'):.1f} / {mean(rs, 'gb_in'):.1f} ({mean(rs, 'copy_calls'):,.0f})",
            f"{sum(r['completed'] for r in rs):,}, {sum(r['failed'] for r in rs)}"]) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="1500:10,1750:12,3500:13", help="blocks:RT rate, ...")
    ap.add_argument("--seeds", default="9,1,2,3")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--profile", default="llama3-8b-a100")
    ap.add_argument("--policies", default="bros,bench/bros_swap.policy")
    ap.add_argument("--cpu-swap-blocks", type=int, default=None,
                    help="host blocks (default: as many as the device has)")
    if (args := args_or_report(ap, report)) is None:
        return 0
    install()
    out: list[dict[str, Any]] = []
    for point in args.points.split(","):
        blocks, rate = int(point.split(":")[0]), float(point.split(":")[1])
        config = EngineConfig(backend="sim", profile=args.profile, num_blocks=blocks,
                              block_size=16, max_batched_tokens=2048, max_num_seqs=256,
                              max_queued_requests=100_000, cpu_swap_blocks=args.cpu_swap_blocks)
        for seed in args.seeds.split(","):
            spec = f"rtbe:rate={rate},duration={args.duration:g},seed={seed}"
            for p in args.policies.split(","):
                row = {"num_blocks": blocks, "rate": rate, "seed": int(seed), "spec": spec,
                       "cpu_swap_blocks": config.cpu_swap_blocks, **run(p, spec, config)}
                out.append(row)
                print(json.dumps(finite(row)), flush=True)
                if args.json:  # as it goes: a long sweep keeps what it ran
                    args.json.write_text(json.dumps(finite(out), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
