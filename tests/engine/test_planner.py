"""The planner fits an order to blocks, tokens and sequences: table-driven cases."""

from __future__ import annotations

import attrs

from engine.planner import blocks_for, plan_iteration
from engine.policy import Decision
from tests.factories import fcfs, make_budget, make_view, running


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_waiting_requests_admitted_in_order_with_prefill_chunked_to_budget():
    a, b, c = make_view(prompt_tokens=40), make_view(prompt_tokens=40), make_view(prompt_tokens=8)
    plan = plan_iteration(fcfs(a, b, c), [a, b, c], make_budget(max_batched_tokens=64))
    assert plan.work == {a.id: 40, b.id: 24}
    assert plan.block_targets == {a.id: 10, b.id: 6}
    assert [v.id for v in plan.admitted] == [a.id, b.id]


def test_decode_takes_one_token_and_grows_a_block_only_at_a_boundary():
    inside = running(blocks=2, computed=6, prompt_tokens=6)     # token 7 fits block 2
    boundary = running(blocks=2, computed=8, prompt_tokens=8)   # token 9 needs block 3
    plan = plan_iteration(fcfs(inside, boundary), [inside, boundary], make_budget())
    assert plan.work == {inside.id: 1, boundary.id: 1}
    assert plan.block_targets == {inside.id: 2, boundary.id: 3}


def test_a_running_prompt_takes_its_next_chunk_and_the_blocks_it_fills():
    # 10 of 30 prompt tokens computed in 3 blocks of 4: a 16-token chunk reaches token 26
    chunk = running(blocks=3, computed=10, prompt_tokens=30, output=0)
    plan = plan_iteration(fcfs(chunk), [chunk], make_budget(max_batched_tokens=16, free_blocks=4))
    assert (plan.work, plan.block_targets) == ({chunk.id: 16}, {chunk.id: 7})
    tight = plan_iteration(fcfs(chunk), [chunk], make_budget(max_batched_tokens=16, free_blocks=3))
    assert (tight.work, [v.id for v in tight.preempted]) == ({}, [chunk.id])


def test_out_of_blocks_preempts_the_least_deserving_running_request():
    old = running(blocks=2, computed=8, prompt_tokens=8)
    young = running(blocks=2, computed=8, prompt_tokens=8)
    plan = plan_iteration(fcfs(old, young), [old, young], make_budget(free_blocks=0, total_blocks=4))
    assert plan.work == {old.id: 1}
    assert plan.block_targets == {old.id: 3}
    assert [v.id for v in plan.preempted] == [young.id]


def test_a_request_that_cannot_grow_and_is_last_preempts_itself():
    only = running(blocks=4, computed=16, prompt_tokens=16)
    plan = plan_iteration(fcfs(only), [only], make_budget(free_blocks=0, total_blocks=5))
    assert plan.work == {}
    assert [v.id for v in plan.preempted] == [only.id]


def test_fcfs_admission_is_strict_nobody_jumps_ahead():
    big, small = make_view(prompt_tokens=40), make_view(prompt_tokens=4)
    plan = plan_iteration(fcfs(big, small), [big, small], make_budget(free_blocks=5))
    assert plan.work == {}


def test_without_displace_waiting_requests_do_not_evict_running_ones():
    holder = running(blocks=8, computed=30, prompt_tokens=30, arrival=5.0)
    urgent = make_view(prompt_tokens=12, arrival=1.0)
    plan = plan_iteration(fcfs(holder, urgent), [holder, urgent], make_budget(free_blocks=1, total_blocks=9))
    assert plan.work == {holder.id: 1}
    assert plan.preempted == []


def test_with_displace_a_more_deserving_waiting_request_evicts_a_running_one():
    holder = running(blocks=8, computed=30, prompt_tokens=30, arrival=5.0)
    urgent = make_view(prompt_tokens=12, arrival=1.0)
    decision = Decision(order=[urgent, holder], displace=True)
    plan = plan_iteration(decision, [holder, urgent], make_budget(free_blocks=1, total_blocks=9))
    assert plan.work == {urgent.id: 12}
    assert [v.id for v in plan.preempted] == [holder.id]


def test_requests_left_out_of_the_order_are_idle_but_are_the_first_victims():
    kept = running(blocks=2, computed=8, prompt_tokens=8)
    left_out = running(blocks=2, computed=6, prompt_tokens=6)
    plan = plan_iteration(Decision(order=[kept]), [kept, left_out], make_budget(free_blocks=0, total_blocks=4))
    assert plan.work == {kept.id: 1}
    assert [v.id for v in plan.preempted] == [left_out.id]


def test_batch_limit_and_class_limit():
    views = [make_view(prompt_tokens=4, request_class="be") for _ in range(5)]
    plan = plan_iteration(fcfs(*views, max_batch=3), views, make_budget())
    assert len(plan.work) == 3
    plan = plan_iteration(fcfs(*views), views, make_budget(max_running={"be": 2}))
    assert len(plan.work) == 2


def test_never_preempt_leaves_stuck_requests_idle_then_breaks_the_deadlock():
    a = running(blocks=2, computed=8, prompt_tokens=8)
    b = running(blocks=2, computed=8, prompt_tokens=8)
    plan = plan_iteration(fcfs(a, b), [a, b], make_budget(free_blocks=0, total_blocks=4, can_preempt=False))
    assert plan.forced
    assert [v.id for v in plan.preempted] == [b.id]
    assert plan.work == {a.id: 1}


def test_a_packed_batch_gets_work_and_the_rest_only_ranks_victims():
    # BROS: the order is the batch (one new request) then the running requests left out; it
    # takes the blocks of the last one (the least deserving), never of the one ranked above it
    new = make_view(prompt_tokens=12)
    kept = running(blocks=3, computed=10, prompt_tokens=10)
    lent = running(blocks=3, computed=10, prompt_tokens=10)
    decision = Decision(order=[new, kept, lent], batch=1, displace=True)
    plan = plan_iteration(decision, [new, kept, lent], make_budget(free_blocks=1, total_blocks=7))
    assert plan.work == {new.id: 12}
    assert [v.id for v in plan.preempted] == [lent.id]
    whole = plan_iteration(attrs.evolve(decision, batch=None), [new, kept, lent],
                           make_budget(free_blocks=1, total_blocks=7))
    assert set(whole.work) == {new.id, kept.id}


def test_displacing_evicts_nobody_when_the_newcomer_would_still_not_fit():
    """Issue 13: victims evicted for a request that then did not fit came straight back next
    iteration and were evicted again (a swap ping-pong)."""
    top = running(blocks=8, computed=30, prompt_tokens=30, arrival=1.0)
    low = running(blocks=2, computed=6, prompt_tokens=6, arrival=5.0)
    big = make_view(prompt_tokens=40, arrival=2.0)           # 10 blocks: 1 free + 2 from low
    plan = plan_iteration(Decision(order=[top, big, low], displace=True), [top, low, big],
                          make_budget(free_blocks=1, total_blocks=11))
    assert plan.preempted == [] and plan.admitted == []
    assert plan.work == {top.id: 1, low.id: 1}


def test_an_async_swap_in_comes_back_only_if_it_could_compute_when_it_lands():
    """Issue 13: a request swapped in asynchronously with room for its KV but not for its next
    prefill chunk preempted itself as soon as it landed, and came back, again and again."""
    # 20 tokens computed of a 60-token prompt: its KV is 5 blocks, its next chunk 10 more
    half = make_view(state="swapped", prompt_tokens=60, computed_tokens=20, swapped_blocks=5)
    for free, back in ((8, False), (15, True)):
        plan = plan_iteration(Decision(order=[half], displace=True), [half],
                              make_budget(free_blocks=free, total_blocks=20, async_swap_in=True))
        assert [v.id for v in plan.swapped_in] == ([half.id] if back else [])
        assert plan.work == {}                                  # asynchronous: computes later
        assert plan.block_targets == ({half.id: 5} if back else {})


def test_short_of_block_self_preempts_the_request_that_lacks_the_block():
    """`short_of_block = self` (BROS §7.4.1's ablation, "recomputation for requests failing to
    acquire cache blocks"): the request that cannot grow goes, not the ones ranked below it."""
    old = running(blocks=2, computed=8, prompt_tokens=8)     # needs a third block
    young = running(blocks=2, computed=6, prompt_tokens=6)   # token 7 fits its second block
    budget = make_budget(free_blocks=0, total_blocks=4)
    below = plan_iteration(fcfs(old, young), [old, young], budget)
    assert ([v.id for v in below.preempted], below.work) == ([young.id], {old.id: 1})
    own = plan_iteration(fcfs(old, young), [old, young], attrs.evolve(budget, short_self=True))
    assert ([v.id for v in own.preempted], own.work) == ([old.id], {young.id: 1})
