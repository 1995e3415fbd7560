"""Where bros's BE throughput goes in a small pool (issue 14; round 10d: 2 RT/s on 700 blocks,
where bros serves 0.87x the literal bros_no_bicache's BE).

One `rtbe` workload per policy (same arrivals, uncharged simulator virtual time, so the counts
are deterministic), counting per iteration, averaged:
- what each step carries (`actors.scheduler.build_run_step`, before the fit): RT and BE
  requests, their tokens, BE prefill tokens, BE requests waiting in the queue;
- with the bidirectional cache (`BidirectionalMemory.fit`, after it): BE requests in the table,
  displaced ones (slots overwritten, waiting to be swapped back), wholly free blocks;
- packing's skips of BE requests short of wholly free blocks (`Batch.reverse_short`): how many,
  the blocks they needed (with their restore's), and the free blocks left at that point.

    python bench/bros_be_stall.py --num-blocks 700 --rate 2 --policies bros,bros_no_bicache
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import actors.scheduler as scheduler
from engine import bidirectional_step
from engine.bidirectional_step import best_effort
from policy_lang import pack_batch
from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.workloads import load_workload

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
        return out

    scheduler.build_run_step = counted_build
    bidirectional_step.BidirectionalMemory.fit = counted_fit
    pack_batch.Batch.reverse_short = counted_short


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-blocks", type=int, default=700)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--policies", default="bros,bros_no_bicache")
    args = ap.parse_args()
    install()
    for policy in args.policies.split(","):
        C.clear()
        config = EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=args.num_blocks,
                              max_batched_tokens=512, max_num_seqs=64, max_queued_requests=100_000)
        w = load_workload(f"rtbe:rate={args.rate},duration={args.duration:g},seed={args.seed}")
        m = run_one(parse_policy(policy), w, config, progress=False,
                    clock_limit_s=20 * w.duration_s).metrics
        n, skips = max(C["iterations"], 1), max(C["be_skips"], 1)
        per_it = {k: round(v / n, 2) for k, v in C.items()
                  if k not in ("iterations", "be_skips") and not k.startswith("skip_")}
        print(f"{policy}: BE {m.by_class['be']['requests_per_s']:.3f} req/s, RT TTFT ok "
              f"{m.by_class['rt']['slo_attainment']['ttft']:.3f}, iterations {C['iterations']}, "
              f"per iteration {per_it}, BE skips {C['be_skips']} (needing "
              f"{C['skip_need_blocks'] / skips:.1f} blocks, {C['skip_free_blocks'] / skips:.2f} "
              f"free)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
