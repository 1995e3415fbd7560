"""`prefill separate` (vLLM V0's `_schedule_default`, engine/planner.py `separate_phases`):
whole prompts alone, else decodes. Table-driven cases on the planner."""

from __future__ import annotations

from engine.planner import plan_iteration
from tests.factories import fcfs, make_budget, make_view, running


def separate(**kw: object):
    return make_budget(separate_prefill=True, **kw)


def test_a_waiting_prompt_stops_the_decodes_of_that_iteration():
    a, b = running(blocks=3, computed=10), running(blocks=3, computed=10)
    new = make_view(prompt_tokens=40)
    plan = plan_iteration(fcfs(a, b, new), [a, b, new], separate())
    assert plan.work == {new.id: 40}
    mixed = plan_iteration(fcfs(a, b, new), [a, b, new], make_budget())
    assert mixed.work == {a.id: 1, b.id: 1, new.id: 40}


def test_prompts_are_whole_the_first_that_does_not_fit_stops_admission():
    a, b, c = (make_view(prompt_tokens=40), make_view(prompt_tokens=40),
               make_view(prompt_tokens=8))
    plan = plan_iteration(fcfs(a, b, c), [a, b, c], separate(max_batched_tokens=64))
    assert plan.work == {a.id: 40}  # b is not chunked into the 24 left, and c does not pass it
    assert [v.id for v in plan.admitted] == [a.id]


def test_decodes_run_when_no_prompt_fits_memory_and_no_prompt_joins_them():
    a = running(blocks=3, computed=12, prompt_tokens=12)  # the 13th token needs a 4th block
    new = make_view(prompt_tokens=40)  # needs 10 blocks
    plan = plan_iteration(fcfs(a, new), [a, new], separate(free_blocks=5, total_blocks=8))
    assert plan.work == {a.id: 1}
    assert plan.admitted == []


def test_a_prompt_leaves_the_watermark_free():
    new = make_view(prompt_tokens=40)  # 10 blocks
    assert plan_iteration(fcfs(new), [new], separate(free_blocks=12)).work == {new.id: 40}
    plan = plan_iteration(fcfs(new), [new], separate(free_blocks=12, watermark_blocks=3))
    assert plan.work == {}


def test_the_sequence_cap_counts_the_running_requests():
    a, b = running(blocks=3, computed=10), running(blocks=3, computed=10)
    new = make_view(prompt_tokens=4)
    plan = plan_iteration(fcfs(a, b, new), [a, b, new], separate(max_num_seqs=2))
    assert plan.work == {a.id: 1, b.id: 1}


def test_a_prompt_longer_than_the_whole_budget_is_chunked_alone():
    big, small = make_view(prompt_tokens=100), make_view(prompt_tokens=4)
    plan = plan_iteration(fcfs(big, small), [big, small], separate(max_batched_tokens=64))
    assert plan.work == {big.id: 64}


def test_decodes_preempt_the_latest_arrival_by_recompute_when_blocks_run_out():
    old = running(blocks=2, computed=8, prompt_tokens=8)
    young = running(blocks=2, computed=8, prompt_tokens=8)
    plan = plan_iteration(fcfs(old, young), [old, young], separate(free_blocks=0, total_blocks=4))
    assert plan.work == {old.id: 1}
    assert [v.id for v in plan.preempted] == [young.id]


def test_swapped_requests_come_back_before_new_prompts():
    back = make_view(state="swapped", prompt_tokens=8, output_tokens=2, swapped_blocks=3)
    a = running(blocks=3, computed=10)
    new = make_view(prompt_tokens=4)
    plan = plan_iteration(fcfs(back, a, new), [back, a, new], separate())
    assert new.id not in plan.work
    assert plan.work[a.id] == 1 and [v.id for v in plan.swapped_in] == [back.id]
