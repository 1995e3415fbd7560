"""A plan becomes one `RunStep` without touching the requests; then the requests move as it says;
then a finished step lands on them."""

from __future__ import annotations

import attrs

from engine.messages import (
    AddRequest,
    RequestSetup,
    SampledToken,
    SeqWork,
    StepFinished,
    SwapIn,
    SwapOut,
)
from engine.planner import IterationPlan
from engine.policy import PolicySettings
from engine.request import Request
from engine.step_plan import build_run_step, finish_step, start_step
from shunter import SamplingParams, SchedulingParams

SETTINGS = PolicySettings(name="p")


def _make_request(request_id: int, prompt: int = 6, **state: object) -> Request:
    r = Request.admit(AddRequest(request_id=request_id, prompt_ids=tuple(range(prompt)),
                                 sampling=SamplingParams(max_tokens=3),
                                 scheduling=SchedulingParams(), arrival=0.0, eos_token_ids=()),
                      SETTINGS, turn=1)
    return attrs.evolve(r, **state)


def _plan(requests: dict[int, Request]) -> IterationPlan:
    """1 decodes, 2 is new, 3 comes back synchronously, 4 asynchronously, 5 is preempted."""
    views = {rid: r.view() for rid, r in requests.items()}
    return IterationPlan(work={1: 1, 2: 6, 3: 1}, block_targets={1: 2, 2: 2, 3: 2, 4: 1},
                         swapped_in=[views[3], views[4]], preempted=[views[5]])


def _requests() -> dict[int, Request]:
    return {
        1: _make_request(1, state="running", computed_tokens=6, blocks=2, output_ids=[9],
                         known_to_executor=True),
        2: _make_request(2),
        3: _make_request(3, state="swapped", computed_tokens=6, swapped_blocks=2,
                         output_ids=[9], known_to_executor=True),
        4: _make_request(4, state="swapped", computed_tokens=4, swapped_blocks=1),
        5: _make_request(5, state="running", computed_tokens=6, blocks=2),
    }


def _fields(r: Request) -> dict:
    """Every field but the view it keeps (a cache, filled by reading it)."""
    return attrs.asdict(r, filter=lambda a, _: a.name != "_view")


def test_a_run_step_carries_the_plan_and_changes_nothing():
    requests = _requests()
    before = {rid: _fields(r) for rid, r in requests.items()}
    out = SwapOut(request_id=5, first_block=0, cpu_blocks=(8, 9))
    step = build_run_step(_plan(requests), step_id=4, requests=requests,
                          swap_in_blocks={3: (1, 2), 4: (3,)}, release=[6], swap_out=[out],
                          granularity="groups")
    assert (step.step_id, step.release, step.preempt, step.swap_out) == (4, (6,), (5,), (out,))
    assert step.block_targets == ((1, 2), (2, 2), (3, 2), (4, 1))
    assert step.swap_in == (SwapIn(request_id=3, cpu_blocks=(1, 2), sync=True),
                            SwapIn(request_id=4, cpu_blocks=(3,), sync=False))
    # swap-ins first, then the work; only requests the executor has not seen get a setup
    assert [s.request_id for s in step.setups] == [4, 2]
    assert step.setups[1] == RequestSetup(request_id=2, prompt_ids=tuple(range(6)),
                                          sampling=SamplingParams(max_tokens=3), eos_token_ids=())
    assert step.seqs == (SeqWork(request_id=1, start=6, num_tokens=1, sample=True),
                         SeqWork(request_id=2, start=0, num_tokens=6, sample=True),
                         SeqWork(request_id=3, start=6, num_tokens=1, sample=True))
    assert step.granularity == "groups"
    assert {rid: _fields(r) for rid, r in requests.items()} == before


def test_starting_the_step_moves_the_requests_it_names():
    requests = _requests()
    plan = _plan(requests)
    step = build_run_step(plan, step_id=1, requests=requests, swap_in_blocks={3: (1, 2), 4: (3,)},
                          release=[], swap_out=[], granularity="groups")
    in_flight = start_step(plan, step, requests, now=2.0)
    assert list(in_flight) == [1, 2, 3]
    r = requests
    assert [(r[i].state, r[i].blocks, r[i].in_flight_tokens) for i in (1, 2, 3)] == [
        ("running", 2, 1), ("running", 2, 6), ("running", 2, 1)]
    assert (r[3].swapped_blocks, r[4].state, r[4].blocks, r[4].swap_started) == (
        0, "swapping_in", 1, 2.0)
    assert all(r[i].known_to_executor for i in (1, 2, 3, 4)) and not r[5].known_to_executor


def test_finishing_the_step_lands_tokens_and_endings_in_order():
    requests = {1: _make_request(1, prompt=4), 2: _make_request(2, prompt=4),
                3: _make_request(3, prompt=4)}
    for rid, r in requests.items():
        r.schedule(4 if rid < 3 else 2, blocks=1, now=1.0)
    requests[2].abort_reason = "cancelled"
    views = {rid: r.view() for rid, r in requests.items()}    # as the policy saw them
    msg = StepFinished(step_id=1, compute_s=0.1, stall_s=0.5,
                       sampled=(SampledToken(request_id=1, token_id=7),
                                SampledToken(request_id=2, token_id=8)))
    result = finish_step(msg, requests, views, now=3.0, max_context=5, limit="pool")
    assert [(r.id, token, why) for r, token, why in result.events] == [
        (1, 7, "pool"), (2, None, "cancelled")]              # 1 reached the pool's limit
    assert [(v.id, prompt, output) for v, prompt, output in result.served] == [(1, 3, 1), (3, 2, 0)]
    assert result.served[0][0] is views[1] and result.deadline_misses == 0
    assert [r.computed_tokens for r in requests.values()] == [4, 4, 2]
    assert requests[2].output_ids == [] and requests[1].swap_stall_s == 0.5
