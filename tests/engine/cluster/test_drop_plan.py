"""KunServe's drop plan (§4.1): greedy grouping, checked as properties and on examples."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cluster.drop_plan import InstanceCapacity, group_pool, plan_drop, queue_moves


def _cluster(draw_pools, used, queued):
    return [InstanceCapacity(index=i, pool_blocks=p, used_blocks=min(u, p), queued_blocks=q)
            for i, (p, u, q) in enumerate(zip(draw_pools, used, queued))]


instances = st.integers(1, 8).flatmap(lambda n: st.tuples(
    st.lists(st.integers(10, 200), min_size=n, max_size=n),
    st.lists(st.integers(0, 200), min_size=n, max_size=n),
    st.lists(st.integers(0, 400), min_size=n, max_size=n)))


def _free(g, by, w):
    return sum(by[i].pool_blocks - by[i].used_blocks for i in g) + (len(g) - 1) * w


def _demand(g, by):
    return sum(by[i].queued_blocks for i in g)


@settings(max_examples=300, deadline=None)
@given(instances, st.integers(0, 300), st.integers(1, 40))
def test_greedy_grouping_properties(cluster, weight_blocks, num_layers):
    inst = _cluster(*cluster)
    by = {c.index: c for c in inst}
    plan = plan_drop(inst, num_layers=num_layers, weight_blocks=weight_blocks)
    free0 = sum(c.pool_blocks - c.used_blocks for c in inst)
    demand = sum(c.queued_blocks for c in inst)
    short = {c.index for c in inst if c.pool_blocks - c.used_blocks < c.queued_blocks}
    if plan is None:
        # refused only when no grouping fits: one group of all frees too little, or the
        # model has fewer layers than a group would need stages
        assert short
        assert free0 + (len(inst) - 1) * weight_blocks < demand or num_layers < len(inst)
        return
    # every instance in exactly one group; every group holds every layer exactly once
    members = sorted(i for g in plan.groups for i in g.members)
    assert members == [c.index for c in inst]
    for g in plan.groups:
        layers = [layer for r in g.layers for layer in r]
        assert layers == list(range(num_layers)) and len(g.layers) == g.size
        assert all(len(r) > 0 for r in g.layers)
        # each group holds its own members' queued demand
        assert _free(g.members, by, weight_blocks) >= _demand(g.members, by)
        # no unnecessary cooperation: a group is formed only around an instance that
        # could not hold its own queue
        if g.size > 1:
            assert set(g.members) & short
    assert plan.free_blocks >= plan.demand_blocks == demand
    if not short:
        assert not plan.merged


def test_one_overloaded_instance_gets_a_partner_while_others_have_free_memory():
    """Per-instance overload (§4.1): the cluster as a whole has room (60 + 3 x 90 free blocks
    against a queue of 100), but instance 0 cannot hold its own queue, so it is grouped."""
    inst = [InstanceCapacity(index=0, pool_blocks=100, used_blocks=90, queued_blocks=100)] + [
        InstanceCapacity(index=i, pool_blocks=100, used_blocks=10, queued_blocks=0)
        for i in (1, 2, 3)]
    plan = plan_drop(inst, num_layers=32, weight_blocks=400)
    assert [g.members for g in plan.groups] == [(0, 1), (2,), (3,)]


def test_a_group_still_short_grows_by_the_next_smallest():
    inst = [InstanceCapacity(index=0, pool_blocks=100, used_blocks=100, queued_blocks=900)] + [
        InstanceCapacity(index=i, pool_blocks=100, used_blocks=100, queued_blocks=0)
        for i in (1, 2, 3)]
    plan = plan_drop(inst, num_layers=32, weight_blocks=400)
    # (0,1) frees 400 < 900; (0,1)+(2) frees 800 < 900; (0,1,2)+(3) frees 1200
    assert [g.members for g in plan.groups] == [(0, 1, 2, 3)]


def test_two_of_four_pair_up_when_one_copy_is_enough():
    inst = [InstanceCapacity(index=i, pool_blocks=100, used_blocks=90, queued_blocks=q)
            for i, q in enumerate((100, 0, 0, 0))]
    plan = plan_drop(inst, num_layers=32, weight_blocks=400)
    assert [g.members for g in plan.groups] == [(0, 1), (2,), (3,)]
    assert plan.groups[0].layers == (range(16), range(16, 32))
    assert group_pool([100, 100], 400) == 600


def test_no_drop_when_memory_is_free():
    inst = [InstanceCapacity(index=i, pool_blocks=100, used_blocks=10, queued_blocks=50)
            for i in range(4)]
    plan = plan_drop(inst, num_layers=32, weight_blocks=400)
    assert all(g.size == 1 for g in plan.groups) and not plan.merged


def test_head_is_the_member_holding_most_kv():
    inst = [InstanceCapacity(index=0, pool_blocks=100, used_blocks=20, queued_blocks=300),
            InstanceCapacity(index=1, pool_blocks=100, used_blocks=95, queued_blocks=0)]
    plan = plan_drop(inst, num_layers=4, weight_blocks=400)
    assert plan.groups[0].members == (1, 0)


def test_existing_groups_are_kept_and_grown():
    inst = [InstanceCapacity(index=i, pool_blocks=100, used_blocks=100, queued_blocks=0)
            for i in range(4)]
    inst[3] = InstanceCapacity(index=3, pool_blocks=100, used_blocks=100, queued_blocks=300)
    plan = plan_drop(inst, num_layers=32, weight_blocks=400, groups=[(0, 1)])
    # (0,1) fits (it freed one copy already); (3) is short and its smallest partner is (2)
    assert sorted(g.members for g in plan.groups) == [(0, 1), (2, 3)]
    inst[1] = InstanceCapacity(index=1, pool_blocks=100, used_blocks=0, queued_blocks=600)
    plan = plan_drop(inst, num_layers=32, weight_blocks=400, groups=[(0, 1)])
    # now (0,1) is short too: it is the smallest short one after (3)+(2) and grows with it
    assert [g.members for g in plan.groups] == [(0, 1, 2, 3)]


def test_refused_when_even_one_group_cannot_hold_it():
    inst = [InstanceCapacity(index=i, pool_blocks=100, used_blocks=100, queued_blocks=1000)
            for i in range(2)]
    assert plan_drop(inst, num_layers=32, weight_blocks=400) is None


class _Stats:
    def __init__(self, waiting: int, queued_tokens: int, free_blocks: int) -> None:
        self.waiting, self.queued_tokens, self.free_blocks = waiting, queued_tokens, free_blocks


def test_queued_requests_move_to_the_head_with_most_room_only_when_they_do_not_fit_at_home():
    stats = [
        _Stats(0, 0, 10),        # 0: head of group (0, 1), 10 blocks free
        _Stats(3, 999, 0),       # 1: a member: never moves its queue
        _Stats(2, 64, 2),        # 2: alone, 64 tokens queued, 32 fit at home -> moves
        _Stats(1, 16, 1),        # 3: alone, fits at home -> stays
        None,                    # 4: did not answer
        _Stats(0, 0, 30),        # 5: head of group (5, 6), most room
        _Stats(0, 0, 0),         # 6: member
        _Stats(4, 600, 0),       # 7: alone, more than any head holds -> stays
        _Stats(2, 40, 0),        # 8: alone but dead -> stays
    ]
    alive = [True] * 8 + [False]
    moves = queue_moves(stats, block_size=16, grouped={0, 1, 5, 6}, heads=[0, 5], alive=alive)
    assert moves == [(2, 5)]
    alive[5] = False  # a dead head takes nothing: the next best is 0 (160 tokens free)
    assert queue_moves(stats, block_size=16, grouped={0, 1, 5, 6}, heads=[0, 5],
                       alive=alive) == [(2, 0)]


def test_a_head_with_its_own_queue_takes_no_queued_requests():
    stats = [_Stats(0, 0, 10), _Stats(0, 0, 0), _Stats(2, 64, 2), None, None,
             _Stats(1, 16, 30), _Stats(0, 0, 0)]  # head 5 has the most room, and a queue
    kw = {"block_size": 16, "grouped": {0, 1, 5, 6}, "heads": [0, 5], "alive": [True] * 7}
    assert queue_moves(stats, **kw) == [(2, 0)]
    stats[0] = _Stats(1, 16, 10)
    assert queue_moves(stats, **kw) == []  # every head queues
