"""One iteration's plan fitted to BROS's bidirectional blocks (§5.2), for a policy that turns them
on (`memory { bidirectional on }`).

The planner (engine/planner.py) chose the requests and their tokens against a block budget in
which a best-effort (BE) block still counts as room for a real-time (RT) request
(`planning_free`). This fits that choice to the slots, RT requests first, then BE:
- RT requests grow left to right into free blocks, then into BE blocks with the most empty slots,
  overwriting BE slots only after lazily checkpointing them to the host (block preemption);
- a BE request (a request with no TTFT or TPOT goal) grows right to left in free blocks, its
  last, partly filled block in the empty right side of the RT block with the most empty slots
  when none is free (a guest, which RT's growth there checkpoints slot by slot like any BE
  slot); one whose slots were overwritten first swaps back exactly its checkpointed slots, or
  waits;
- when an RT request still finds no room (§5.2's extreme case), requests outside the step are
  swapped out whole, BE first, then RT, the one with the most time left first; so are the
  planner's own victims when the policy preempts by swap (`swap_out`, called by the scheduler
  before the fit), into the table's copy space: whole blocks in block groups, shared blocks
  slot-masked (engine/memory/slot_swap.py); a swapped request swaps back in with its step;
- a request that cannot be placed leaves the step (it keeps its KV and tries again next time).
The result is one `BidirectionalOrders`: the changed block tables and every slot copy, all done
before the step computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.memory.bidirectional import BidirectionalBlocks, SlotCopies
from engine.memory.slot_batches import StepCopies
from engine.memory.slot_runs import NO_COPIES
from engine.messages import BidirectionalOrders, BlockUpdate, SwapTransfer
from engine.planner import IterationPlan
from engine.request import Request


def best_effort(r: Request) -> bool:
    """BROS's BE requests: those with neither a TTFT nor a TPOT goal."""
    return r.ttft_ms is None and r.tpot_ms is None


class BidirectionalMemory:
    def __init__(self, block_ids: range, block_size: int, host_slots: int,
                 copy_blocks: range | None = None, *, gather: bool = True) -> None:
        self.table = BidirectionalBlocks(block_ids, block_size, host_slots,
                                         copy_blocks=copy_blocks)
        self.gather = gather
        """Batch each step's slot copies by direction where their order allows
        (engine/memory/slot_batches.py), so that the copier gathers a step's checkpoints in one
        call (gpu/slot_copy.py); False: one transfer per change and direction."""
        self._sent: dict[int, list[int]] = {}
        """The block table the executor holds for each request."""
        self._pending: list[tuple[int, SlotCopies]] = []
        """Copies of the scheduler's victims swapped out since the last fit (its step's first)."""
        self.swapped_out = 0
        """Requests swapped out whole by the extreme case since the start."""
        self.victims_swapped = 0
        """Of those, the scheduler's victims (`swap_out`), the rest `_make_room`'s."""
        self.recomputed = 0
        """Requests `_make_room` recomputed because nothing fit and none could be swapped out."""
        self.steps = 0
        """Fits since the start: one per step the scheduler built."""
        self.overwriting_steps = 0
        """Of those, steps in which RT overwrote BE slots (lazily checkpointing them first)."""
        self.restores = 0
        """Swap-backs of a displaced BE request's checkpointed slots (`restore`) since the start."""
        self.last_copied: set[int] = set()
        """Requests whose KV the last fitted step's slot copies carried (`step_failed`)."""
        self.recomputed_after_failures = 0
        """Requests `step_failed` recomputed since the start."""

    def swap_out(self, rid: int) -> bool:
        """The scheduler preempts request `rid` by swap (the planner's victim: BE first, then RT
        by slack, as the policy ranks them): its KV goes to the table's copy space now, its
        copies first in the next step. False when it cannot (no copy space, no room there,
        nothing computed): the caller recomputes it, and the next fit forgets it."""
        t = self.table
        if not t.has_copy_space or rid not in t or not t.tokens(rid):
            return False
        if not t.swapped(rid):  # else `_make_room` swapped it out already
            if not t.can_swap_out(rid):
                return False
            self._pending.append((rid, t.swap_out(rid)))
            self.swapped_out += 1
            self.victims_swapped += 1
        self._sent.pop(rid, None)
        return True

    def planning_free(self) -> int:
        """The planner's free blocks: those an RT request could still take (free ones and BE
        blocks without an RT guest). Counting what swapping out could free as well made the
        planner fill its token budget with requests `fit` then had to leave out (measured on
        the simulator, bench/results/bros_bicache.md: -10% output tokens/s)."""
        return self.table.rt_room()

    def reverse_free(self) -> int:
        """Blocks packing lets a BE request take: free ones. Its last block may also go to an
        RT block's empty side (`BidirectionalBlocks.guest_block`) when the fit finds none free;
        packing does not count that room."""
        return self.table.num_free

    def fit(self, plan: IterationPlan, requests: Mapping[int, Request],
            release: Sequence[int]) -> BidirectionalOrders:
        """Fit `plan` (changed in place: requests that cannot be placed leave it) and return
        the step's table changes and slot copies."""
        t, transfers = self.table, StepCopies(merge=self.gather)
        self.steps += 1
        checkpointed = t.checkpointed_slots_total
        for rid, copies in self._pending:
            transfers.add(rid, copies)
        self._pending = []
        for rid in [*release, *(v.id for v in plan.preempted
                                if (r := requests.get(v.id)) is None or r.state != "swapped")]:
            if rid in self._sent or rid in t:
                self._forget(rid, requests)
        left: list[tuple[int, int]] = []
        be = {i for i in plan.work if best_effort(requests[i])}
        for rid in [i for i in plan.work if i not in be] + [i for i in plan.work if i in be]:
            r = requests[rid]  # RT first, then BE, each in plan order
            if rid not in t:
                t.add(rid, reverse=rid in be)
            tokens = r.computed_tokens + plan.work[rid]
            if (copies := t.grow(rid, tokens)) is not None:  # `_place`'s first try, inline
                if copies is not NO_COPIES:
                    transfers.add(rid, copies)
            elif not self._place(rid, tokens, plan, requests, transfers):
                left.append((rid, plan.work[rid]))
                _leave(plan, rid)
        if left and not plan.work:  # nobody fits: the others make room for the most deserving
            (rid, n), tokens = left[0], requests[left[0][0]].computed_tokens + left[0][1]
            self._make_room(rid, tokens, plan, requests, transfers, force=True)
            if self._place(rid, tokens, plan, requests, transfers):
                plan.work[rid], plan.block_targets[rid] = n, 0
                if requests[rid].state == "swapped":
                    plan.swapped_in.append(requests[rid].view())
        for rid, _ in left:
            if rid in plan.work or rid not in t:
                continue
            if not t.tokens(rid):  # left out holding no KV: out of the table, which only learns
                t.free(rid)  # of an end the executor knew of or that held blocks (`_finish`)
            elif (r := requests[rid]).state == "swapped" and not t.swapped(rid):
                r.swapped_blocks, r.state = 0, "running"  # swapped in, then found no room:
                r.changed()  # its KV is on the device (else it waits to swap in what it holds)
        self.overwriting_steps += t.checkpointed_slots_total > checkpointed
        self.last_copied, t.copied = t.copied, set()
        blocks, sent = [], self._sent
        for rid in plan.work:
            table = t.entries(rid)  # not a copy: copied only when it changed
            plan.block_targets[rid] = len(table)
            if sent.get(rid) != table:
                sent[rid] = list(table)
                blocks.append(BlockUpdate(request_id=rid, reset=True, append=tuple(table)))
        for rid, held, slots in t.holdings():
            # held: len(table(rid)) without copying it (a table covers its tokens unless
            # swapped); a request's set of host slots only grows or empties within one fit, so
            # an equal count is an equal set. Views are dropped only where these changed (the
            # step's own requests are rescheduled, which drops theirs): tests/sim/test_view_cache.py
            if (r := requests.get(rid)) is not None and (
                    held != r.blocks or slots != r.checkpointed_slots):
                r.blocks = held
                r.checkpointed_slots = slots
                r.checkpointed_blocks = t.checkpointed_blocks(rid) if slots else 0
                r.changed()
        return BidirectionalOrders(blocks=tuple(blocks), transfers=tuple(
            SwapTransfer(request_id=rid, direction=direction, pairs=pairs, sync=True)
            for rid, direction, pairs in transfers))

    def step_failed(self, requests: Mapping[int, Request], in_flight: Mapping[int, Request]
                    ) -> list[Request]:
        """The last step failed (the scheduler fails the requests in it), maybe because one of
        its slot copies did: the KV of requests outside it that those copies carried (a BE
        request checkpointed for an RT one, a victim swapped out, a request swapped back that
        then left the step) may not be where the table says. Each is recomputed: its KV
        dropped, its tokens prefilled again (a copy that failed must not yield wrong tokens;
        found by tests/shunter/test_chaos_bros_faults.py). Returns them."""
        out = []
        for rid in sorted(self.last_copied):
            if (r := requests.get(rid)) is not None and rid not in in_flight:
                self._forget(rid, requests)
                r.recompute()
                out.append(r)
        self.recomputed_after_failures += len(out)
        self.last_copied = set()
        return out

    def _forget(self, rid: int, requests: Mapping[int, Request]) -> None:
        """The table drops the request (its KV and host checkpoints), and the request the
        table's counts of it (`fit` sets them only for requests the table holds): a request
        recomputed by the extreme case or a preemption would otherwise still rank as
        checkpointed (`priority be = checkpointed_blocks asc`) and count blocks to swap back in
        packing until placed again."""
        self._sent.pop(rid, None)
        if rid in self.table:
            self.table.free(rid)
        if (r := requests.get(rid)) is not None and (r.checkpointed_slots or r.checkpointed_blocks):
            r.checkpointed_slots = r.checkpointed_blocks = 0
            r.changed()

    def _place(self, rid: int, tokens: int, plan: IterationPlan, requests: Mapping[int, Request],
               transfers: StepCopies) -> bool:
        t = self.table
        copies = t.grow(rid, tokens)  # most requests of a step: it fits as it is
        if copies is not None:
            transfers.add(rid, copies)
            return True
        if t.swapped(rid):
            if not t.can_swap_in(rid):
                return False
            transfers.add(rid, t.swap_in(rid))
        elif t.displaced(rid):
            if not t.can_restore(rid):
                return False
            transfers.add(rid, t.restore(rid))
            self.restores += 1
        if not t.can_extend(rid, tokens):  # false also while still swapped or displaced
            if t.is_reversed(rid) or t.swapped(rid) or t.displaced(rid):
                return False
            self._make_room(rid, tokens, plan, requests, transfers)
            if not t.can_extend(rid, tokens):
                return False
        transfers.add(rid, t.extend(rid, tokens, checked=True))
        return True

    def _make_room(self, rid: int, tokens: int, plan: IterationPlan,
                   requests: Mapping[int, Request], transfers: StepCopies, *,
                   force: bool = False) -> None:
        """§5.2's extreme case: swap out requests outside the step, BE first, then RT with the
        most time to their next deadline first, until request `rid` fits (`force`: also when it
        is displaced, which its swap-back needs room for too). With a copy space and `force`
        (nothing in the step fits), one that cannot be swapped out, or already is, is
        recomputed instead: a full copy space or checkpoint space would stop the engine."""
        t = self.table
        if t.can_extend(rid, tokens) or (not force and (t.swapped(rid) or t.displaced(rid))):
            return
        drop = force and t.has_copy_space
        idle = [i for i in t.requests()
                if i != rid and i not in plan.work and (drop or not t.swapped(i)) and i in requests]
        idle.sort(key=lambda i: (not t.is_reversed(i), -requests[i].next_deadline()))
        for victim in idle:
            if not t.swapped(victim) and t.can_swap_out(victim):
                transfers.add(victim, t.swap_out(victim))
                self._sent.pop(victim, None)
                self.swapped_out += 1
            elif drop:
                self._forget(victim, requests)
                requests[victim].preemptions += 1
                requests[victim].recompute()
                self.recomputed += 1
            else:
                continue
            if t.can_extend(rid, tokens) or t.can_restore(rid) or t.can_swap_in(rid):
                return


def _leave(plan: IterationPlan, rid: int) -> None:
    """The request leaves the step; one swapped out by a preemption stays so (it swaps in only
    with its step)."""
    plan.work.pop(rid, None)
    plan.block_targets.pop(rid, None)
    plan.admitted = [v for v in plan.admitted if v.id != rid]
    plan.swapped_in = [v for v in plan.swapped_in if v.id != rid]
