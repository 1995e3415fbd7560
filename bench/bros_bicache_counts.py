"""What the bidirectional KV cache does, counted, against what `bros_no_bicache` does instead
(issue 14: why the cache's own gain, BROS §7.4.1's 1.23x TTFT / 1.63x TPOT, does not show).

One `rtbe` workload per point, through `bros` and `bros_no_bicache` (and, with `--ablations`,
the ablation whose RT requests wait for memory), counting per run:

- bros, in the table (engine/memory/bidirectional.py): RT blocks taken free and taken from BE
  blocks (block preemption), the empty BE slots RT used as a guest, the BE slots it overwrote
  (lazy checkpoints), BE blocks moved away, restores (in place, merged), whole requests swapped
  out (§5.2's extreme case), and planned work `fit` dropped because it found no slots;
- every policy, in the planner (engine/planner.py): requests preempted by recompute, by class of
  the victim, and the computed tokens they lost;
- the pool as the table saw it each iteration: free blocks, BE-only blocks and their empty slots
  (the room block preemption can give without overwriting anything);
- the other direction: BE blocks placed as guests in RT blocks' empty right side (when no block
  is free) and the guest slots their RT hosts then overwrote (checkpointed first).

A policy named `bros:noguests` is bros with that other direction turned off (the table's
`guest_block` answers none, which is what the table did before it was built), for an A/B in
one run of this script; `bros:guestplan` lets packing count, beside the free blocks a BE request
may take, the RT blocks with empty slots and no guest yet (one each: a BE request's last block).

    python bench/bros_bicache_counts.py --rates 5,8 --num-blocks 1200 [--block-size 16]

The counting wraps the mechanisms' methods in this process (the simulator runs in it, scheduler
time not charged, so the runs are deterministic); it changes no decision: bros at 8 RT/s on
1,200 blocks gave the same RT TTFT attainment, p99, BE throughput and preemptions counted as under
a plain `shunter bench` (checked 2026-11-24). `--report FILE...` prints the table of
bench/results/bros_bicache_counts.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import structlog

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import bidirectional_step, planner
from engine.memory import bidirectional
from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.commands.bench import finite
from shunter.workloads import load_workload

COUNTS: Counter[str] = Counter()


def _wrap(cls: Any, name: str, count: Any) -> None:
    inner = getattr(cls, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = count(self, "before", args, None)
        out = inner(self, *args, **kwargs)
        count(self, before, args, out)
        return out

    setattr(cls, name, wrapper)


def _count_picks(table: Any, phase: Any, args: Any, out: Any) -> Any:
    if out is None:
        return None
    bs = table.block_size
    COUNTS["rt_blocks_from_be"] += len(out)
    for b in out:
        x = table._blocks[b]
        COUNTS["rt_guest_room_slots"] += bs - x.be_fill + len(x.lost)
        COUNTS["rt_blocks_from_displaced_be"] += bool(table._seqs[x.be].host)
    return None


def _count_extend(table: Any, phase: Any, args: Any, out: Any) -> Any:
    s = table._seqs[args[0]]
    if out is None:  # before
        return (s.tokens, len(s.table), table.checkpointed_slots_total)
    tokens0, blocks0, ck0 = phase
    who = "be" if s.reverse else "rt"
    COUNTS[f"{who}_extends"] += 1
    COUNTS[f"{who}_tokens_placed"] += s.tokens - tokens0
    COUNTS[f"{who}_new_blocks"] += len(s.table) - blocks0
    COUNTS["slots_checkpointed"] += table.checkpointed_slots_total - ck0
    if not s.reverse:  # RT slots written into BE-owned blocks without overwriting BE KV
        bs = table.block_size
        for j in range(tokens0 // bs, -(-s.tokens // bs)):
            x = table._blocks[s.table[j]]
            if x.be >= 0:
                lo, hi = max(tokens0, j * bs) - j * bs, s.tokens - j * bs
                COUNTS["rt_slots_in_shared_blocks"] += min(hi, bs) - lo
    if out.move:
        COUNTS["be_block_moves"] += 1
    return None


def _wrap_extends(cls: Any) -> None:
    """`grow` (the fit's first try: `extend` when it can, else None) and `extend` both place
    tokens, and `grow` may call `extend`: each placement is counted once, by the outer call."""
    depth = [0]
    for name in ("grow", "extend"):
        inner = getattr(cls, name)

        def wrapper(self: Any, rid: int, tokens: int, *args: Any, _inner: Any = inner,
                    **kwargs: Any) -> Any:
            depth[0] += 1
            try:
                before = (_count_extend(self, "before", (rid, tokens), None) if depth[0] == 1
                          else None)
                out = _inner(self, rid, tokens, *args, **kwargs)
            finally:
                depth[0] -= 1
            if before is not None and out is not None:
                _count_extend(self, before, (rid, tokens), out)
            return out

        setattr(cls, name, wrapper)


def _count_restore(table: Any, phase: Any, args: Any, out: Any) -> Any:
    if out is not None:
        COUNTS["restores"] += 1
        COUNTS["restore_slots_in"] += len(out.into)
        COUNTS["restore_slots_merged"] += len(out.move)
    return None


def _count_swap_out(table: Any, phase: Any, args: Any, out: Any) -> Any:
    if out is not None:
        who = "be" if table._seqs[args[0]].reverse else "rt"
        COUNTS[f"swap_out_{who}"] += 1
        COUNTS["swap_out_slots"] += len(out.out)
    return None


def _count_fit(mem: Any, phase: Any, args: Any, out: Any) -> Any:
    plan = args[0]
    if out is None:
        return {rid: n for rid, n in plan.work.items()}
    requests = args[1]
    for rid, n in phase.items():
        if rid not in plan.work:
            who = "be" if bidirectional_step.best_effort(requests[rid]) else "rt"
            COUNTS[f"fit_dropped_{who}"] += 1
            COUNTS[f"fit_dropped_{who}_tokens"] += n
    t = mem.table
    COUNTS["fit_iterations"] += 1
    COUNTS["sum_free_blocks"] += t.num_free
    COUNTS["sum_be_only_blocks"] += len(t._be_only)
    COUNTS["sum_be_only_empty_slots"] += sum(
        t.block_size - t._blocks[b].be_fill for b in t._be_only)
    COUNTS["iterations_no_free_block"] += t.num_free == 0
    COUNTS["be_guest_blocks"] = t.guest_blocks_total  # running totals of this run's table
    COUNTS["be_guest_slots_checkpointed"] = t.guest_checkpointed_total
    # the room BE could still take in RT blocks: empty slots of blocks with an RT owner and no
    # BE one
    COUNTS["sum_rt_only_empty_slots"] += sum(
        t.block_size - x.rt_fill for x in t._blocks.values() if x.rt >= 0 and x.be < 0)
    COUNTS["sum_shared_blocks"] += len(t._blocks) - t.num_free - len(t._be_only) - sum(
        1 for b, x in t._blocks.items() if x.be < 0 and x.rt >= 0)
    return None


def _count_preempt(p: Any, phase: Any, args: Any, out: Any) -> Any:
    if phase == "before":
        v = args[0]
        COUNTS[f"recompute_preempt_{v.request_class}"] += 1
        COUNTS[f"recompute_lost_tokens_{v.request_class}"] += v.computed_tokens
    return None


def _count_iteration(p: Any, phase: Any, args: Any, out: Any) -> Any:
    """Every policy, per iteration, as the planner sees it: the blocks RT and BE requests hold,
    the RT requests still waiting for their first chunk, and whether the sequence cap binds."""
    if phase == "before":
        return None
    requests, budget = args[1], args[2]
    rt_blocks = be_blocks = rt_waiting = running = 0
    for r in requests:
        be = r.ttft_ms is None and r.tpot_ms is None
        if be:
            be_blocks += r.blocks
        else:
            rt_blocks += r.blocks
            rt_waiting += r.state == "waiting"
        running += r.state == "running"
    COUNTS["iterations"] += 1
    COUNTS["sum_rt_blocks"] += rt_blocks
    COUNTS["sum_be_blocks"] += be_blocks
    COUNTS["sum_planner_free_blocks"] += budget.free_blocks
    COUNTS["sum_rt_waiting"] += rt_waiting
    COUNTS["sum_running"] += running
    COUNTS["max_rt_blocks"] = max(COUNTS["max_rt_blocks"], rt_blocks)
    COUNTS["iterations_seq_cap"] += running >= budget.max_num_seqs
    COUNTS["iterations_rt_waiting"] += rt_waiting > 0
    return None


_RESERVED: list[int] = []


def _count_try(pack: Any, phase: Any, args: Any, out: Any) -> Any:
    """Packing's verdict on each RT request: skipped for memory (its blocks neither free nor
    lendable: FindPreemptBlock found none) is what a bidirectional cache could change."""
    batch, r = args[0], args[2]
    if phase == "before":
        _RESERVED.clear()
        return None
    if r.ttft_ms is not None or r.tpot_ms is not None:
        if out == "skip" and _RESERVED:
            COUNTS[f"pack_rt_memory_skip_{r.state}"] += 1
        elif out == "skip":
            COUNTS["pack_rt_token_skip"] += 1
    return None


def _note_reserve(batch: Any, phase: Any, args: Any, out: Any) -> Any:
    if phase == "before":
        _RESERVED.append(args[0])
    return None


def install() -> None:
    from policy_lang import pack_batch, packing
    _wrap(planner._Planner, "__init__", _count_iteration)
    _wrap(packing.PackOrder, "_try", _count_try)
    _wrap(pack_batch.Batch, "reserve", _note_reserve)
    t = bidirectional.BidirectionalBlocks
    _wrap(t, "_preemption_order", _count_picks)
    _wrap_extends(t)
    _wrap(t, "restore", _count_restore)
    _wrap(t, "swap_out", _count_swap_out)
    _wrap(bidirectional_step.BidirectionalMemory, "fit", _count_fit)
    _wrap(planner._Planner, "preempt", _count_preempt)


def run(policy: str, spec: str, config: EngineConfig) -> dict[str, Any]:
    COUNTS.clear()
    workload = load_workload(spec)
    name, _, variant = policy.partition(":")
    t, guest_block = bidirectional.BidirectionalBlocks, bidirectional.BidirectionalBlocks.guest_block
    mem, reverse_free = bidirectional_step.BidirectionalMemory, \
        bidirectional_step.BidirectionalMemory.reverse_free
    if variant == "noguests":
        t.guest_block = lambda self, slots: None  # type: ignore[method-assign]
    elif variant == "guestplan":  # packing also counts RT blocks a BE block could be a guest in
        mem.reverse_free = lambda self: self.table.num_free + sum(  # type: ignore[method-assign]
            1 for s in self.table._seqs.values() if not s.reverse and s.table
            and (x := self.table._blocks[s.table[-1]]).be < 0 and x.rt_fill < self.table.block_size)
    try:
        o = run_one(parse_policy(name), workload, config, progress=False,
                    clock_limit_s=20 * workload.duration_s)
    finally:
        t.guest_block = guest_block  # type: ignore[method-assign]
        mem.reverse_free = reverse_free  # type: ignore[method-assign]
    if o.metrics is None:
        return {"policy": policy, "error": o.error}
    m = o.metrics
    rt, be = m.by_class.get("rt", {}), m.by_class.get("be", {})
    a = rt.get("slo_attainment", {})
    n = max(1, COUNTS["fit_iterations"])
    every = ("sum_rt_blocks", "sum_be_blocks", "sum_planner_free_blocks", "sum_rt_waiting",
             "sum_running")  # counted every iteration, for every policy
    pool = {k.replace("sum_", "mean_"): round(COUNTS.pop(k) / (
        max(1, COUNTS["iterations"]) if k in every else n), 1)
            for k in list(COUNTS) if k.startswith("sum_")}
    return {"policy": policy, "rt_ttft_ok": a.get("ttft"), "rt_tpot_ok": a.get("tpot"),
            "rt_tpot_ok_per_token": a.get("tpot_per_token"),
            "rt_ttft_p99_ms": rt["ttft_ms"]["p99"],
            "rt_norm_latency_ms": rt["normalized_latency_ms"]["mean"],
            "be_requests_per_s": be.get("requests_per_s", 0.0),
            "preemptions": m.preemptions, "counts": dict(COUNTS), "pool": pool,
            "wall_s": round(o.wall_s, 1)}


def report(paths: list[Path]) -> str:
    """One markdown table of every run in these JSON files."""
    out = [("| setting | RT/s | policy | RT TTFT ok | RT TPOT ok per token | BE req/s | "
           "recompute preemptions RT / BE (BE tokens lost) | iterations with no free block | "
           "BE-only blocks, their empty slots (mean) | RT blocks taken from BE (of displaced "
           "BE) | RT slots written in BE blocks: empty / overwritten | restores | "
           "swapped out whole BE / RT | BE guest blocks in RT blocks (guest slots RT "
           "overwrote) |"), "|---" * 14 + "|"]
    for path in paths:
        for r in json.loads(path.read_text()):
            c, pool = r["counts"], r["pool"]
            setting = (f"{r['num_blocks']} x {r['block_size']}, {r['max_batched_tokens']} tok, "
                       f"{r['profile']}")
            bros = "fit_iterations" in c
            guest = c.get("rt_slots_in_shared_blocks", 0) - c.get("slots_checkpointed", 0)
            out.append(" | ".join([
                f"| {setting}", f"{r['rate']:g}",
                r["policy"].split("/")[-1].replace(".policy", "").replace(":", " "),
                f"{100 * r['rt_ttft_ok']:.1f}%", f"{100 * r['rt_tpot_ok_per_token']:.1f}%",
                f"{r['be_requests_per_s']:.2f}",
                (f"{c.get('recompute_preempt_rt', 0)} / {c.get('recompute_preempt_be', 0)} "
                f"({c.get('recompute_lost_tokens_be', 0):,})"),
                f"{c['iterations_no_free_block']:,} of {c['fit_iterations']:,}" if bros else "-",
                f"{pool['mean_be_only_blocks']:.0f}, {pool['mean_be_only_empty_slots']:.0f}"
                if bros else "-",
                f"{c.get('rt_blocks_from_be', 0):,} ({c.get('rt_blocks_from_displaced_be', 0):,})"
                if bros else "-",
                f"{guest:,} / {c.get('slots_checkpointed', 0):,}" if bros else "-",
                f"{c.get('restores', 0):,}" if bros else "-",
                f"{c.get('swap_out_be', 0)} / {c.get('swap_out_rt', 0)}" if bros else "-",
                (f"{c['be_guest_blocks']:,} ({c['be_guest_slots_checkpointed']:,})"
                 if "be_guest_blocks" in c else "-")]) + " |")
    return "\n".join(out) + "\n"


def args_or_report(ap: argparse.ArgumentParser,
                   report: Callable[[list[Path]], str]) -> argparse.Namespace | None:
    """The arguments, with `--json OUT` and `--report JSON...` added. With `--report`: print
    `report`'s table of those files and return None; else quiet the engine's logs below warnings
    for the runs (bench/bros_swap_round9.py uses it too)."""
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--report", type=Path, nargs="+", default=None,
                    help="print one markdown table of these --json files instead of running")
    args = ap.parse_args()
    if args.report:
        print(report(args.report), end="")
        return None
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    return args


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="5,8")
    ap.add_argument("--num-blocks", type=int, default=1200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--workload", default="rtbe:rate={rate},duration={duration:g},seed=9",
                    help="spec with {rate} and {duration}")
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64,
                    help="the engine's sequence cap (64, the engine's default, in rounds 4-5; "
                    "bench/bros_compare.py runs every policy at vLLM V0's 256 since round 6)")
    ap.add_argument("--profile", default="llama3-8b-a100")
    ap.add_argument("--policies", default="bros_no_bicache,bros")
    ap.add_argument("--ablations", action="store_true",
                    help="also bench/bros_no_bicache_no_displace.policy (RT waits for memory)")
    if (args := args_or_report(ap, report)) is None:
        return 0
    install()
    config = EngineConfig(backend="sim", profile=args.profile, num_blocks=args.num_blocks,
                          block_size=args.block_size, max_batched_tokens=args.max_batched_tokens,
                          max_num_seqs=args.max_num_seqs, max_queued_requests=100_000)
    policies = args.policies.split(",") + (
        ["bench/bros_no_bicache_no_displace.policy"] if args.ablations else [])
    out: list[dict[str, Any]] = []
    for rate in (float(r) for r in args.rates.split(",")):
        spec = args.workload.format(rate=rate, duration=args.duration)
        for p in policies:
            row = {"rate": rate, "spec": spec, **attrs.asdict(config, filter=lambda a, v: a.name in (
                "num_blocks", "block_size", "max_batched_tokens", "max_num_seqs", "profile")), **run(p, spec, config)}
            out.append(row)
            print(json.dumps(finite(row)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(finite(out), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
