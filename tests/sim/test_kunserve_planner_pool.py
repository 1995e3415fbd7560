"""The monitor's planner sizes a group as the group manager will: an uneven group (three
members of Llama-3-8B, layers 11 | 11 | 10) gets its smallest member's stage capacity
(sim/arena_layout.py `group_pool_blocks`, as torch's gpu/stage_view.py), which falls far short
of the members' pools plus a copy of the layers a member past the first. Planned with that
linear count, a pair short of memory took one more instance and became a group of three whose
real pool could not hold the queue it was formed for."""

from __future__ import annotations

from pathlib import Path
import trio
import trio.testing

from engine.cluster.dispatch import InstanceStats
from engine.cluster.drop_plan import GroupPlan
from engine.cluster.overload import Drop, OverloadMonitor
from engine.cluster.plan import stage_layers
from policies import policy_path
from policy_lang.api import compile_policy
from shunter.cluster.groups import policy_triggers
from sim.arena_layout import freed_blocks, planned_pool, sized_pool
from sim.profile import load_profile
from tests.sim.test_kunserve_group_pool import _burst

BS = 16
BASE = 2469  # the A10 profile's pool (sim/profile.py `Profile.num_blocks`)
AT_ONCE = 'policy at_once extends "kunserve.policy" {\n  overload restore when kv_usage < 50%\n}\n'


def _policy():
    return compile_policy(AT_ONCE, filename="<test>", base_dir=Path(policy_path("fcfs")).parent)


def _monitor(pool) -> OverloadMonitor:
    model = load_profile("llama3-8b-a10").model
    return OverloadMonitor(base_pools=[BASE] * 4, block_size=BS, num_layers=model.num_layers,
                           weight_blocks=freed_blocks(model, BS),
                           triggers=policy_triggers(_policy()),
                           pool=planned_pool(model, BS) if pool else None)


def _stats(*, used: int, total: int, queued: int = 0) -> InstanceStats:
    return InstanceStats(waiting=1 if queued else 0, running=1, swapped=0,
                         free_blocks=total - used, total_blocks=total,
                         queued_tokens=queued * BS, head_tokens=queued * BS)


def _plan(pool: bool) -> tuple[OverloadMonitor, Drop]:
    """Pair (0, 1) runs with 11,000 blocks held and a queue of 3,000 blocks; 2 and 3 are alone
    and nearly empty. A group of three would have 13,714 blocks (20,783 counted linearly)."""
    m = _monitor(pool)
    model = load_profile("llama3-8b-a10").model
    pair = GroupPlan(group_id=0, members=(0, 1), layers=stage_layers(model.num_layers, 2))
    m.formed(pair)
    stats = [_stats(used=11_000, total=sized_pool(model, BS, [BASE] * 2, pair.layers),
                    queued=3_000), _stats(used=0, total=BASE),
             _stats(used=100, total=BASE), _stats(used=100, total=BASE)]
    alive = [True] * 4
    action = m.decide(stats, alive) or m.decide(stats, alive)  # `for 2 iterations`
    assert isinstance(action, Drop), action
    return m, action


def test_the_planner_sizes_an_uneven_group_as_it_will_be():
    model = load_profile("llama3-8b-a10").model
    three = sized_pool(model, BS, [BASE] * 3, stage_layers(model.num_layers, 3))
    assert three == 13_714 < 3 * BASE + 2 * freed_blocks(model, BS)
    m, action = _plan(pool=True)
    # three would leave 13,714 - 11,200 = 2,514 free for 3,000: the pair takes both singles
    assert [g.members for g in action.new_groups] == [(0, 1, 2, 3)]
    for g in action.plan.merged:  # every planned group holds its queue in its real pool
        pools = [BASE] * g.size
        used = 11_000 + 100 * (g.size - 2)
        assert sized_pool(model, BS, pools, g.layers) - used >= 3_000
    assert m.pool([BASE] * 4) == 4 * BASE + 3 * freed_blocks(model, BS)  # even: linear


def test_plan_drop_sizes_groups_with_the_pool_it_is_given():
    """engine/cluster/drop_plan.py `plan_drop(pool=...)` on the same four instances: with the
    linear count the short pair takes one single; with torch's pool, both."""
    from engine.cluster.drop_plan import InstanceCapacity, plan_drop

    model = load_profile("llama3-8b-a10").model
    inst = [InstanceCapacity(index=0, pool_blocks=BASE, used_blocks=11_000, queued_blocks=3_000),
            InstanceCapacity(index=1, pool_blocks=BASE, used_blocks=0, queued_blocks=0),
            InstanceCapacity(index=2, pool_blocks=BASE, used_blocks=100, queued_blocks=0),
            InstanceCapacity(index=3, pool_blocks=BASE, used_blocks=100, queued_blocks=0)]
    kw = dict(num_layers=model.num_layers, weight_blocks=freed_blocks(model, BS),
              groups=[(0, 1)])
    assert [g.members for g in plan_drop(inst, **kw).merged] == [(0, 1, 2)]
    plan = plan_drop(inst, **kw, pool=planned_pool(model, BS))
    assert [g.members for g in plan.merged] == [(0, 1, 2, 3)]
    assert plan.free_blocks == 4 * BASE + 3 * freed_blocks(model, BS) - 11_200


def test_a_simulated_clusters_monitor_plans_with_its_group_managers_pool():
    """The in-process cluster's monitor (shunter/cluster/groups.py `overload_monitor`) is given
    the pool `SimGroups.pool_of` gives a forming group, for each size."""
    ends, _, groups = trio.run(_burst, 3, 60, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(ends) == 60
    assert groups.monitor.pool is not None
    layers = groups.model.num_layers
    for k in (2, 3):
        g = GroupPlan(group_id=0, members=tuple(range(k)), layers=stage_layers(layers, k))
        assert groups.monitor.pool([300] * k) == groups.pool_of(g)
    assert groups.monitor.pool([300] * 3) == 9_376

