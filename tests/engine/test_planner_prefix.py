"""The planner with the device prefix cache: a hit is computed from its end and pays only for
the blocks it takes from the free count; a preempted request frees only blocks nobody else
holds."""

from __future__ import annotations

from engine.planner import plan_iteration
from tests.factories import fcfs, make_budget, make_view, running


def test_a_hit_computes_the_rest_and_pays_for_new_and_idle_blocks_only():
    # block size 4: 32 cached tokens are 8 blocks, 3 of them idle; 8 tokens to compute need 2
    def hit():
        return make_view(prompt_tokens=40, cached_tokens=32, cached_idle_blocks=3)

    r = hit()
    plan = plan_iteration(fcfs(r), [r], make_budget(free_blocks=5, total_blocks=20))
    assert plan.work == {r.id: 8} and plan.block_targets == {r.id: 10}
    r = hit()
    plan = plan_iteration(fcfs(r), [r], make_budget(free_blocks=4, total_blocks=20))
    assert plan.work == {} and plan.admitted == []


def test_preempting_a_request_whose_blocks_are_shared_frees_only_its_own():
    needy = running(blocks=2, computed=8, prompt_tokens=8)          # its next token needs a block
    own = running(blocks=2, computed=8, prompt_tokens=8)
    sharer = running(blocks=4, computed=16, prompt_tokens=16, shared_blocks=4)
    requests = [needy, own, sharer]
    plan = plan_iteration(fcfs(*requests), requests, make_budget(free_blocks=0, total_blocks=8))
    # the sharer goes first (least deserving) but frees nothing, so the next one goes too
    assert [v.id for v in plan.preempted] == [sharer.id, own.id]
    assert plan.work == {needy.id: 1} and plan.block_targets == {needy.id: 3}
