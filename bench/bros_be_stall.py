"""Where bros's BE throughput goes in a small pool (issue 14; round 10d: 2 RT/s on 700 blocks,
where bros serves 0.87x the literal bros_no_bicache's BE).

One `rtbe` workload per policy (same arrivals, uncharged simulator virtual time, so the counts
are deterministic), counting per iteration, averaged:
- what each step carries (`actors.scheduler.build_run_step`, before the fit): RT and BE
  requests, their tokens, BE prefill tokens, BE requests waiting in the queue;
- with the bidirectional cache (`BidirectionalMemory.fit`, after it): BE requests in the table,
  displaced ones (slots overwritten, waiting to be swapped back), wholly free blocks;
- packing's skips of BE requests short of wholly free blocks (`Batch.reverse_short`): how many,
  the blocks they needed (with their restore's), the free blocks left at that point, and whose
  (new, swapped, decode, prefill);
- `be fill` stops (a BE chunk's predicted iteration past min_slack: the TPOT binding), the
  adaptive batch size (its limit, iterations whose batch reached it, resets), the simulated
  iteration time (and how many passed 200 ms), planner preemptions.

    python bench/bros_be_stall.py --num-blocks 700 --rate 2 --policies bros,bros_no_bicache
    python bench/bros_be_stall.py --profile llama3-8b-a10 --num-blocks 2300 \
      --max-batched-tokens 2048 --max-num-seqs 256 --rate 5 --duration 120 --policies fcfs,bros
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio

import actors.scheduler as scheduler
from bench.bros_probe import probe_parser, run_policy
from engine import bidirectional_step, planner
from engine.bidirectional_step import best_effort
from policy_lang import pack_batch, packing, state
from sim import runner

C: Counter[str] = Counter()


def install() -> None:
    build, fit, short = (scheduler.build_run_step, bidirectional_step.BidirectionalMemory.fit,
                         pack_batch.Batch.reverse_short)

    def counted_build(plan, *, requests, **kw):
        be = {i: n for i, n in plan.work.items() if best_effort(requests[i])}
        C["iterations"] += 1
        C["rt_run"] += len(plan.work) - len(be)
        C["be_run"] += len(be)
        C["tokens"] += sum(plan.work.values())
        C["be_tokens"] += sum(be.values())
        C["be_prefill_tokens"] += sum(n for n in be.values() if n > 1)
        C["be_queued"] += sum(1 for r in requests.values() if best_effort(r) and r.state == "waiting")
        return build(plan, requests=requests, **kw)

    def counted_fit(self, plan, requests, release):
        out = fit(self, plan, requests, release)
        t = self.table
        be = [i for i in t.requests() if t.is_reversed(i)]
        C["be_in_table"] += len(be)
        C["be_displaced"] += sum(1 for i in be if t.displaced(i))
        C["free_blocks"] += t.num_free
        return out

    def counted_short(self, r, need, extra=0):
        out = short(self, r, need, extra)
        if out:
            C["be_skips"] += 1
            C["skip_need_blocks"] += need + r.checkpointed_blocks
            C["skip_free_blocks"] += self.reverse_free
            C["skip_checkpointed_blocks"] += r.checkpointed_blocks
            C["skip_of_" + ("new" if r.state == "waiting" else r.state if r.state != "running"
                            else "decode" if r.remaining_tokens <= 1 else "prefill")] += 1
        return out

    step, take_try, pack, limit = (runner.SimRunner.step, packing.PackOrder._try,
                                   packing.PackOrder.__call__, state.AdaptiveBatch.limit)
    preempt = planner._Planner.preempt

    async def timed_step(self, s):
        began = anyio.current_time()
        done = await step(self, s)
        ms = (anyio.current_time() - began) * 1000.0
        C["iteration_ms"] += ms
        C["iterations_over_200ms"] += ms > 200.0
        return done

    def counted_try(self, batch, step_, r, remaining, lender, rank, late_ok):
        before = batch.tokens_left
        out = take_try(self, batch, step_, r, remaining, lender, rank, late_ok)
        if out == packing.STOP and r.ttft_ms is None and r.tpot_ms is None:
            # a BE chunk whose predicted iteration passed min_slack: `be fill` stops there
            C["be_fill_stops"] += 1
            C["stop_chunk_tokens"] += min(remaining, before)
            C["stop_tokens_left"] += before
            C["stop_min_slack_ms"] += min(batch.min_slack, 10_000.0)
            C["stop_est_ms"] += self._env.est_iteration
        return out

    def counted_pack(self, view, lim):
        out = pack(self, view, lim)
        C["at_batch_limit"] += self.batch >= (lim or view.max_num_seqs)
        return out

    def counted_limit(self, view):
        out = limit(self, view)
        C["adaptive_limit"] += out
        C["adaptive_resets"] = self.resets  # a running total: per iteration below
        return out

    def counted_preempt(self, v):
        C["preemptions"] += 1
        C["be_preemptions"] += best_effort(v)
        preempt(self, v)

    runner.SimRunner.step = timed_step
    packing.PackOrder._try = counted_try
    packing.PackOrder.__call__ = counted_pack
    state.AdaptiveBatch.limit = counted_limit
    planner._Planner.preempt = counted_preempt
    scheduler.build_run_step = counted_build
    bidirectional_step.BidirectionalMemory.fit = counted_fit
    pack_batch.Batch.reverse_short = counted_short


def main() -> int:
    args = probe_parser(__doc__, num_blocks=700, rate=2.0, duration=60.0,
                        policies="bros,bros_no_bicache", profile="llama3-8b-a100",
                        max_batched_tokens=512, max_num_seqs=64).parse_args()
    install()
    for policy in args.policies.split(","):
        C.clear()
        m = run_policy(policy, args)
        n, skips = max(C["iterations"], 1), max(C["be_skips"], 1)
        stops = max(C["be_fill_stops"], 1)
        per_it = {k: round(v / n, 2) for k, v in C.items()
                  if k not in ("iterations", "be_skips", "be_fill_stops", "preemptions",
                               "be_preemptions", "iterations_over_200ms", "adaptive_resets")
                  and not k.startswith(("skip_", "stop_"))}
        print(f"{policy}: BE {m.by_class['be']['requests_per_s']:.3f} req/s, RT TTFT ok "
              f"{m.by_class['rt']['slo_attainment']['ttft']:.3f}, iterations {C['iterations']}, "
              f"per iteration {per_it}, BE skips {C['be_skips']} (needing "
              f"{C['skip_need_blocks'] / skips:.1f} blocks, of them "
              f"{C['skip_checkpointed_blocks'] / skips:.1f} to restore, "
              f"{C['skip_free_blocks'] / skips:.2f} free; of "
              + ", ".join(f"{k[8:]} {v}" for k, v in sorted(C.items()) if k.startswith("skip_of_"))
              + f"), BE fill stops {C['be_fill_stops']} (chunk "
              f"{C['stop_chunk_tokens'] / stops:.0f} tokens of {C['stop_tokens_left'] / stops:.0f} "
              f"left, est {C['stop_est_ms'] / stops:.1f} ms, min_slack "
              f"{C['stop_min_slack_ms'] / stops:.1f} ms), iterations over 200 ms "
              f"{C['iterations_over_200ms']}, batch size resets {C['adaptive_resets']}, preemptions {C['preemptions']} (BE "
              f"{C['be_preemptions']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
