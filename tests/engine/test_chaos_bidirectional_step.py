"""Found by tests/sim/test_chaos_bros_sim.py (cancels at awkward moments): what the
bidirectional step (engine/bidirectional_step.py) keeps of a request its ending cannot reach."""

from __future__ import annotations

from engine.bidirectional_step import BidirectionalMemory
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
