"""The bidirectional step (engine/bidirectional_step.py) keeps the requests' memory fields in
step with its table: a request the step leaves out can still change there (RT overwrites its
slots, or the extreme case swaps it out), and its next view must say so, whatever transitions
do or do not run on it in between."""

from __future__ import annotations

import attrs

from engine.bidirectional_step import BidirectionalMemory
from engine.messages import AddRequest
from engine.planner import IterationPlan
from engine.policy import PolicySettings
from engine.request import Request
from shunter import SamplingParams, SchedulingParams

BS = 4


def _make_request(request_id: int, prompt: int, **state: object) -> Request:
    r = Request.admit(AddRequest(request_id=request_id, prompt_ids=tuple(range(prompt)),
                                 sampling=SamplingParams(max_tokens=3),
                                 scheduling=SchedulingParams(), arrival=0.0, eos_token_ids=()),
                      PolicySettings(name="p"), turn=1)
    return attrs.evolve(r, **state)


def _step(mem: BidirectionalMemory, requests: dict[int, Request], work: dict[int, int]) -> None:
    """One fitted step, with the transitions the scheduler runs on the requests in it."""
    plan = IterationPlan(work=dict(work))
    mem.fit(plan, requests, release=())
    for rid, tokens in plan.work.items():
        requests[rid].schedule(tokens, plan.block_targets[rid], now=0.0)
        requests[rid].step_done(0.0, now=0.0)


def test_a_request_left_out_shows_what_rt_did_to_its_slots_in_its_next_view():
    mem = BidirectionalMemory(range(2), BS, host_slots=16)
    be = _make_request(1, prompt=2 * BS)  # no TTFT or TPOT goal: best effort
    rt = _make_request(2, prompt=2, ttft_ms=400.0)
    requests = {1: be, 2: rt}
    _step(mem, requests, {1: 2 * BS})  # BE fills both blocks
    assert be.view().blocks == 2 and be.view().checkpointed_blocks == 0  # a view kept
    _step(mem, requests, {2: 2})  # BE left out; RT preempts one of its blocks, two slots
    assert mem.table.displaced(1) and be.checkpointed_slots == 2
    view = be.view()
    assert view.checkpointed_blocks == 1 and view.blocks == 2


def test_a_request_swapped_out_by_the_extreme_case_shows_no_blocks_in_its_next_view():
    mem = BidirectionalMemory(range(1), BS, host_slots=16)
    be = _make_request(1, prompt=BS)
    rt = _make_request(2, prompt=2 * BS, ttft_ms=400.0)
    requests = {1: be, 2: rt}
    _step(mem, requests, {1: BS})
    assert be.view().blocks == 1
    _step(mem, requests, {2: 2 * BS})  # two blocks for RT in a one-block pool: nothing fits
    # the step then makes room for RT by swapping BE out whole (§5.2's extreme case); RT
    # still does not fit, but BE's fields follow the table
    assert mem.table.swapped(1)
    view = be.view()
    assert view.blocks == 0 and view.checkpointed_blocks == 1
