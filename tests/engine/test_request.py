"""The scheduler's request record: intake from `AddRequest`, the frozen view it gives policies,
its refusals and its transitions."""

from __future__ import annotations

import math

import pytest

from engine.messages import AddRequest
from engine.policy import ClassSpec, PolicySettings, RequestView
from engine.request import Request, refusal
from shunter import SamplingParams, SchedulingParams

SETTINGS = PolicySettings(name="p", classes=(ClassSpec(name="rt", ttft_ms=500.0, tpot_ms=50.0,
                                                       max_queued=1),
                                             ClassSpec(name="be")), default_class="be")


def _make_add(request_id: int = 7, *, ignore_eos: bool = False, **scheduling: object) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_ids=(1, 2, 3),
                      sampling=SamplingParams(max_tokens=5, stop_token_ids=(9,),
                                              ignore_eos=ignore_eos),
                      scheduling=SchedulingParams(**scheduling),  # type: ignore[arg-type]
                      arrival=10.0, eos_token_ids=(2,))


def test_admit_takes_deadlines_from_the_class_unless_the_request_sets_its_own():
    rt = Request.admit(_make_add(request_class="rt", tpot_ms=20.0, tenant="a",
                                 conversation_id="c", priority=3), SETTINGS, turn=2)
    assert (rt.id, rt.request_class, rt.ttft_ms, rt.tpot_ms) == (7, "rt", 500.0, 20.0)
    assert (rt.tenant, rt.conversation_id, rt.turn, rt.priority) == ("a", "c", 2, 3)
    assert (rt.state, rt.computed_tokens, rt.blocks, rt.stop_ids) == ("waiting", 0, 0, {2, 9})
    be = Request.admit(_make_add(ignore_eos=True), SETTINGS, turn=1)
    assert (be.request_class, be.ttft_ms, be.tpot_ms, be.stop_ids) == ("be", None, None, {9})


def test_the_view_carries_every_field_of_the_request_at_its_moment():
    r = Request.admit(_make_add(request_class="rt", conversation_id="c", priority=4,
                                trace_id="1/7"), SETTINGS, turn=3)
    r.state, r.computed_tokens, r.blocks, r.swapped_blocks = "running", 4, 2, 1
    r.checkpointed_blocks, r.preemptions, r.last_scheduled_at = 5, 6, 11.0
    r.add_token(40, now=10.25)
    r.add_token(41, now=10.5)
    v = r.view()
    assert v._asdict() == dict(
        id=7, request_class="rt", priority=4, tenant="default", conversation_id="c", turn=3,
        arrival=10.0, prompt_tokens=3, max_tokens=5, ttft_ms=500.0, tpot_ms=50.0,
        state="running", output_tokens=2, computed_tokens=4, blocks=2, swapped_blocks=1,
        checkpointed_blocks=5, preemptions=6, first_token_at=10.25, last_token_at=10.5,
        last_scheduled_at=11.0, deadline=pytest.approx(10.35), trace_id="1/7",
        cached_tokens=0, cached_idle_blocks=0, shared_blocks=0)  # the prefix cache fills these
    assert (v.context_tokens, v.remaining_tokens, v.deadline) == (5, 1, r.next_deadline())
    assert (v.waited_s(12.0), v.slack_ms(12.0)) == (1.0, pytest.approx((10.35 - 12.0) * 1000))
    with pytest.raises(AttributeError):
        v.state = "waiting"  # type: ignore[misc]


def test_a_view_before_the_first_token_waits_since_arrival():
    v = Request.admit(_make_add(), SETTINGS, turn=1).view()
    assert (v.waited_s(10.5), v.slack_ms(10.5), v.first_token_at) == (0.5, math.inf, None)
    assert isinstance(v, RequestView)


def test_refusals_name_the_class_and_the_policy():
    assert refusal(_make_add(request_class="x"), SETTINGS, []) == \
        "unknown request class 'x' (policy p declares: rt, be)"
    queued = [Request.admit(_make_add(rid, request_class="rt"), SETTINGS, turn=1) for rid in (1, 2)]
    assert refusal(_make_add(request_class="rt"), SETTINGS, queued[:1]) is None
    assert refusal(_make_add(request_class="rt"), SETTINGS, queued) == \
        "class rt already has 1 queued requests (max_queued in policy p)"
    queued[0].state = "running"                      # running requests are not queued
    assert refusal(_make_add(request_class="rt"), SETTINGS, queued) is None


def test_a_step_moves_the_request_on():
    r = Request.admit(_make_add(), SETTINGS, turn=1)
    r.schedule(3, blocks=1, now=10.5)
    assert (r.state, r.in_flight_tokens, r.blocks, r.first_scheduled) == ("running", 3, 1, 10.5)
    r.step_done(stall_s=0.25, now=11.0)
    assert (r.computed_tokens, r.in_flight_tokens, r.swap_stall_s, r.last_scheduled_at) == \
        (3, 0, 0.25, 11.0)
    r.add_token(9, now=11.0)
    assert r.stop_reason(9, max_context=100) == "stop"
    assert r.stop_reason(8, max_context=4) == "context"      # cut short: never `length`
    assert r.stop_reason(8, max_context=4, limit="pool") == "pool"
    r.recompute()
    assert (r.state, r.computed_tokens, r.blocks, r.output_ids) == ("waiting", 0, 0, [9])


def test_swap_transitions_keep_the_block_counts_straight():
    r = Request.admit(_make_add(), SETTINGS, turn=1)
    r.schedule(3, blocks=2, now=10.0)
    r.step_done(stall_s=0.0, now=10.0)
    r.swapped_out(1)
    assert (r.state, r.blocks, r.swapped_blocks) == ("swapped", 0, 1)
    r.start_swap_in(2, now=11.0)
    assert (r.state, r.blocks, r.swapped_blocks) == ("swapping_in", 2, 0)
    r.swap_in_done(now=11.5)
    assert (r.state, r.swap_stall_s) == ("running", 0.5)
