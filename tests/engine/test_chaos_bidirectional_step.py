"""Found by tests/sim/test_chaos_bros_sim.py (cancels at awkward moments): what the
bidirectional step (engine/bidirectional_step.py) keeps of a request its ending cannot reach."""

from __future__ import annotations

from engine.bidirectional_step import BidirectionalMemory
from engine.planner import IterationPlan
from tests.engine.test_bidirectional_step import BS, _make_request, _step


def test_a_request_left_out_before_it_ever_ran_keeps_no_entry_in_the_table():
    """The fit registers each request of the plan in the table before placing it. One that is
    left out of its first step holds nothing, and the executor never heard of it, so when its
    client cancels it the scheduler has nothing to release (actors/scheduler.py `_finish`):
    an entry kept for it stayed in the table for good (chaos seed 5, `recompute`: 'table still
    holds requests [7]')."""
    mem = BidirectionalMemory(range(1), BS, host_slots=16)
    rt = _make_request(2, prompt=2, ttft_ms=400.0)
    be = _make_request(1, prompt=BS)  # best effort: needs a wholly free block
    requests = {1: be, 2: rt}
    _step(mem, requests, {2: 2})  # RT holds the only block
    _step(mem, requests, {2: 1, 1: BS})  # RT grows in its block; nothing is free for BE
    assert mem.table.tokens(2) == 3
    assert 1 not in mem.table and mem.table.requests() == [2]


def test_a_failed_step_recomputes_the_requests_whose_kv_its_copies_carried():
    """RT's step checkpoints BE's slots (a copy out) and then fails (a copy failed, say): the
    BE request, outside the step, would swap back host slots that may hold nothing. It is
    recomputed; the RT request, in the step, is the scheduler's to fail; nothing else is
    touched (found by tests/shunter/test_chaos_bros_faults.py: BE outputs went wrong after a
    slot copy failed, with no error)."""
    mem = BidirectionalMemory(range(3), BS, host_slots=16)
    be = _make_request(1, prompt=2 * BS)
    other = _make_request(3, prompt=BS)
    rt = _make_request(2, prompt=2, ttft_ms=400.0)
    requests = {1: be, 2: rt, 3: other}
    _step(mem, requests, {1: 2 * BS, 3: BS})  # BE fills two blocks, another BE the third
    assert mem.last_copied == set()
    _step(mem, requests, {2: 2})  # RT takes a BE block, checkpointing two of its slots
    assert mem.table.displaced(1) and mem.last_copied == {1}
    recomputed = mem.step_failed(requests, in_flight={2: rt})
    assert recomputed == [be] and be.state == "waiting" and be.computed_tokens == 0
    assert be.checkpointed_slots == 0 and 1 not in mem.table
    assert mem.table.tokens(3) == BS and other.state == "running"
    assert mem.table.free_host_slots == 16, "its checkpoints' host slots are back"


def test_a_request_swapped_in_by_a_step_it_then_leaves_is_not_left_swapped():
    """A swapped-out request planned back in: the fit swaps its KV in (copies in the step),
    then finds no room to grow it, and it leaves the step. Its KV is on the device now: the
    scheduler must not go on counting it swapped out, wanting free blocks for a swap-in of
    what it already holds (found by tests/sim/test_chaos_bros_sim.py, 8 blocks, seed 110,
    `bros`: an RT request held 6 of 8 blocks while its request said swapped, the policy
    planned nothing and three clients waited for ever)."""
    mem = BidirectionalMemory(range(2), BS, host_slots=16, copy_blocks=range(4, 8))
    rt = _make_request(2, prompt=2 * BS, ttft_ms=400.0)
    requests = {2: rt}
    _step(mem, requests, {2: 2 * BS})  # RT fills both blocks
    assert mem.swap_out(2)  # preempted by swap (the scheduler's `_preempt`)
    rt.swapped_out(2)
    _step(mem, requests, {})  # the swap-out's copies go with the next step
    _step(mem, requests, {2: 1})  # back in: both blocks, but no third one to grow into
    assert not mem.table.swapped(2) and mem.table.tokens(2) == 2 * BS
    assert rt.state != "swapped" and rt.swapped_blocks == 0 and rt.blocks == 2


def _displaced_be(host_slots: int, copy_blocks: range | None = None):
    """BE fills both blocks; RT's prompt then overwrites two of BE's slots (checkpointed)."""
    mem = BidirectionalMemory(range(2), BS, host_slots=host_slots, copy_blocks=copy_blocks)
    be = _make_request(1, prompt=2 * BS)
    rt = _make_request(2, prompt=8, ttft_ms=400.0)
    requests = {1: be, 2: rt}
    _step(mem, requests, {1: 2 * BS})
    _step(mem, requests, {2: 2})
    assert mem.table.displaced(1) and be.view().checkpointed_blocks == 1
    return mem, requests, be


def test_a_request_the_extreme_case_recomputes_no_longer_counts_as_checkpointed():
    """RT cannot grow (BE holds its block's other slots and the host has no slot left to
    checkpoint them), nothing else fits, and the displaced BE request cannot be swapped out
    (its two blocks exceed the one-block copy space): the extreme case recomputes it. Its
    checkpoint went with its KV, so it must not rank as still checkpointed
    (`priority be = checkpointed_blocks asc`) nor count a block to swap back in packing."""
    mem, requests, be = _displaced_be(host_slots=2, copy_blocks=range(10, 11))
    plan = IterationPlan(work={2: 2})
    mem.fit(plan, requests, release=())
    assert plan.work == {2: 2} and mem.recomputed == 1 and 1 not in mem.table
    assert be.state == "waiting" and be.computed_tokens == 0
    assert (be.checkpointed_slots, be.view().checkpointed_blocks) == (0, 0)


def test_a_request_preempted_by_recompute_no_longer_counts_as_checkpointed():
    """The planner preempts the displaced BE request and the policy recomputes it (the
    scheduler's `_preempt`); the next fit forgets it, and with it its checkpoint count."""
    mem, requests, be = _displaced_be(host_slots=16)
    view = be.view()
    be.preemptions += 1
    be.recompute()  # as actors/scheduler.py `_preempt` does before the fit
    plan = IterationPlan(work={2: 1}, preempted=[view])
    mem.fit(plan, requests, release=())
    assert 1 not in mem.table and be.state == "waiting"
    assert (be.checkpointed_slots, be.view().checkpointed_blocks) == (0, 0)


def test_a_victim_swapped_out_by_a_failed_step_is_recomputed_with_nothing_swapped():
    """The step carrying a victim's swap-out copies fails: the victim is recomputed (its host
    copy may not hold its KV) and no longer counts blocks on the host, which policies and the
    packing would read as a swap-in to wait for (review s31, item 7)."""
    mem = BidirectionalMemory(range(2), BS, host_slots=16, copy_blocks=range(4, 8))
    rt = _make_request(2, prompt=2 * BS, ttft_ms=400.0)
    requests = {2: rt}
    _step(mem, requests, {2: 2 * BS})
    assert mem.swap_out(2)
    rt.swapped_out(2)
    _step(mem, requests, {})  # the swap-out's copies go with this step, which fails
    assert 2 in mem.last_copied
    assert mem.step_failed(requests, in_flight={}) == [rt]
    assert (rt.state, rt.computed_tokens, rt.swapped_blocks) == ("waiting", 0, 0)
    assert 2 not in mem.table and mem.table.free_host_slots == 16
