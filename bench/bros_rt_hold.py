"""Whether BROS's BE requests wait for memory that guest slots could give (issue 14, round 11):
on the bidirectional table, how much of the pool real-time (RT) requests hold, and by how much
each BE swap-back the fit could not do was short.

One `rtbe` workload per policy (same arrivals, uncharged simulator virtual time, so the counts
are deterministic). After each fit (`BidirectionalMemory.fit`):
- the blocks RT requests own; iterations in which they own at least 95% of the pool ("RT holds
  the pool"): their share, the RT requests still waiting for their first chunk there, and the
  BE tokens an iteration there and elsewhere;
- each swap-back the fit tried and could not do (`_place` of a swapped-out BE request that
  `can_swap_in` refused, or of a displaced one that `can_restore` refused): how many wholly free
  blocks it was short, and of those short by exactly one, how many had a partly filled last
  block that an RT block's empty right side could have taken (a guest, `guest_block`): the most
  that placing swap-backs into guest slots could change;
- requests swapped out whole by the scheduler (`BidirectionalMemory.swap_out`, the planner's
  victims) and the blocks an RT request could take that each swap-out added (`rt_room`).

    python bench/bros_rt_hold.py --profile llama3-8b-a10 --num-blocks 2300 \
      --max-batched-tokens 2048 --max-num-seqs 256 --rate 5 --duration 120 --seed 2
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bros_probe import probe_parser, run_policy
from engine import bidirectional_step
from engine.bidirectional_step import best_effort
from engine.memory.slot_runs import decode

C: Counter[str] = Counter()
SHORT: list[int] = []  # wholly free blocks each refused swap-back lacked

HOLD = 0.95


def _guest_could_take(t, rid: int) -> bool:
    """The request's one missing block is its partly filled last one, and an RT block has the
    empty right-hand slots for it (what a guest placement of the swap-back would use)."""
    bs, tokens = t.block_size, t.tokens(rid)
    tail = tokens % bs
    if not tail:
        return False
    if not t.swapped(rid):  # displaced: its last block must need a fresh one (RT still there)
        j, entries = len(t.entries(rid)) - 1, t.entries(rid)
        if t.block(decode(entries[j])[0])[0] < 0 or not any(
                p // bs == j for p in t.host_slots(rid)):
            return False
    return t.guest_block(tail) is not None


def install() -> None:
    fit, place, swap_out = (bidirectional_step.BidirectionalMemory.fit,
                            bidirectional_step.BidirectionalMemory._place,
                            bidirectional_step.BidirectionalMemory.swap_out)

    def counted_fit(self, plan, requests, release):
        out = fit(self, plan, requests, release)
        t = self.table
        rt_blocks = sum(len(t.entries(i)) for i in t.requests() if not t.is_reversed(i))
        be_tokens = sum(n for i, n in plan.work.items() if best_effort(requests[i]))
        held = rt_blocks >= HOLD * t.num_total
        C["iterations"] += 1
        C["held"] += held
        C["be_tokens_held" if held else "be_tokens_other"] += be_tokens
        C["rt_waiting_held"] += held and sum(
            1 for r in requests.values() if not best_effort(r) and r.state == "waiting")
        return out

    def counted_place(self, rid, tokens, plan, requests, transfers):
        t = self.table
        short = None
        if t.swapped(rid) and not t.can_swap_in(rid):
            short = -(-t.tokens(rid) // t.block_size) - t.num_free
            C["refused_swapped"] += 1
        elif t.displaced(rid) and not t.can_restore(rid):
            short = t.restore_blocks_needed(rid) - t.num_free
            C["refused_displaced"] += 1
        if short is not None:
            SHORT.append(short)
            C["short_by_one"] += short == 1
            C["short_by_one_guest"] += short == 1 and _guest_could_take(t, rid)
        return place(self, rid, tokens, plan, requests, transfers)

    def counted_swap_out(self, rid):
        t = self.table
        before = t.rt_room()
        whole = rid in t and not t.swapped(rid) and t.tokens(rid) > 0
        be = whole and t.is_reversed(rid)
        out = swap_out(self, rid)
        if out and be:
            C["be_victims"] += 1
            C["be_victim_room_gain"] += t.rt_room() - before
        return out

    bidirectional_step.BidirectionalMemory.fit = counted_fit
    bidirectional_step.BidirectionalMemory._place = counted_place
    bidirectional_step.BidirectionalMemory.swap_out = counted_swap_out


def main() -> int:
    args = probe_parser(__doc__, num_blocks=2300, rate=5.0, duration=120.0, policies="bros",
                        profile="llama3-8b-a10", max_batched_tokens=2048,
                        max_num_seqs=256).parse_args()
    install()
    for policy in args.policies.split(","):
        C.clear()
        SHORT.clear()
        m = run_policy(policy, args)
        line = (f"{policy}: BE {m.by_class['be']['requests_per_s']:.3f} req/s, RT TTFT ok "
                f"{m.by_class['rt']['slo_attainment']['ttft']:.3f}")
        if not C["iterations"]:
            print(line + " (no bidirectional table)", flush=True)
            continue
        n, held = C["iterations"], C["held"]
        refused = len(SHORT)
        print(line + f", iterations {n}; RT holds >= {HOLD:.0%} of the pool in {held} "
              f"({held / n:.1%}), RT waiting there {C['rt_waiting_held'] / max(held, 1):.1f}, "
              f"BE tokens an iteration there {C['be_tokens_held'] / max(held, 1):.1f}, elsewhere "
              f"{C['be_tokens_other'] / max(n - held, 1):.1f}; swap-backs refused {refused} "
              f"(swapped {C['refused_swapped']}, displaced {C['refused_displaced']}), short by "
              f"median {statistics.median(SHORT) if SHORT else 0} wholly free blocks, by one "
              f"{C['short_by_one']}, of them a guest could take {C['short_by_one_guest']}; BE "
              f"requests swapped out whole {C['be_victims']}, RT room they added "
              f"{C['be_victim_room_gain']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
