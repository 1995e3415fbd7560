"""What a merge and a one-step restore of three or more members cost on the simulator, as on
torch:
- a re-split: the members that now keep layers they had dropped get them first, from their host
  copies when running groups merge (two pairs into four; gpu/group_merge.py), from the new
  member when a group grows (gpu/group_grow.py), and the group's steps wait for them
  (shunter/cluster/sim_formation.py `merge_load_s`);
- a one-step restore: the head receives every member's KV over its one link
  (shunter/cluster/sim_restore.py `one_step_s`), not each member's over its own."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest
import trio
import trio.testing

from engine.cluster.drop_plan import GroupPlan
from engine.cluster.plan import stage_layers
from engine.config import EngineConfig
from policies import policy_path
from shunter.cluster.cluster import Cluster
from shunter.cluster.sim_formation import gained_layers, merge_load_s
from shunter.cluster.sim_restore import one_step_s
from sim.arena_layout import layer_blocks
from sim.network import NetworkLink
from sim.profile import load_profile
from tests.sim.kunserve_burst import ends_of, start_burst

L = 32
PAIR, FOUR = stage_layers(L, 2), stage_layers(L, 4)


def test_members_gain_the_layers_they_had_dropped():
    before = {0: PAIR[0], 1: PAIR[1], 2: PAIR[0], 3: PAIR[1]}  # pairs (0, 1) and (2, 3)
    four = GroupPlan(group_id=0, members=(0, 1, 2, 3), layers=FOUR)
    assert gained_layers(four, before) == [0, 8, 8, 0]  # 1: 16-31 -> 8-15; 2: 0-15 -> 16-23
    # headed by 2, nobody gains: 2 keeps 0-7 of 0-15, 0 8-15 of 0-15, 1 and 3 halves of 16-31
    assert gained_layers(GroupPlan(group_id=0, members=(2, 0, 1, 3), layers=FOUR), before) \
        == [0, 0, 0, 0]
    assert gained_layers(four, {}) == [0] * 4  # instances alone held every layer
    assert gained_layers(four, {0: PAIR[0], 1: PAIR[1]}) == [0, 8, 0, 0]


def test_a_growth_gets_them_from_the_new_member_a_merge_from_host_copies():
    """A pair (0, 1) grows by instance 2 (layers 11 | 11 | 10): member 1 gains 11-15, sent by
    2 (it holds every layer) over its pipeline link (gpu/group_grow.py `PEER_GAINS`); merged,
    each member would load its own from its host copy (gpu/group_merge.py)."""
    model = load_profile("llama3-8b-a10").model
    link = NetworkLink(name="pipe", latency_s=0.001, bytes_per_s=7.83e9)
    host = NetworkLink(name="host", latency_s=0.0, bytes_per_s=32e9)
    groups = SimpleNamespace(model=model, block_size=16, block_bytes=model.block_bytes(16),
                             link=link, host_link=lambda: host)
    three = GroupPlan(group_id=0, members=(0, 1, 2), layers=stage_layers(L, 3))
    before = {0: PAIR[0], 1: PAIR[1]}
    assert gained_layers(three, before) == [0, 5, 0]
    per = layer_blocks(model, 16) * model.block_bytes(16)
    assert merge_load_s(groups, three, before, merge=False) == pytest.approx(link.send_s(5 * per))
    assert merge_load_s(groups, three, before, merge=True) == pytest.approx(host.send_s(5 * per))
    four = GroupPlan(group_id=0, members=(0, 1, 2, 3), layers=FOUR)
    both = {0: PAIR[0], 1: PAIR[1], 2: PAIR[0], 3: PAIR[1]}
    assert merge_load_s(groups, four, both, merge=True) == pytest.approx(host.send_s(8 * per))
    assert merge_load_s(groups, four, {}, merge=False) == 0.0  # formed from instances alone


def test_a_one_step_restore_of_four_sends_the_members_kv_through_the_heads_link():
    link = NetworkLink(name="t", latency_s=0.001, bytes_per_s=1e9)
    host = NetworkLink(name="h", latency_s=0.0, bytes_per_s=4e9)
    w, k = 800_000_000, 100_000_000
    assert one_step_s(link, None, [w] * 4, [0, k, k, k]) == pytest.approx(link.send_s(w + 3 * k))
    assert one_step_s(link, host, [w] * 4, [0, k, k, k]) == pytest.approx(link.send_s(3 * k))
    # a pair: the head's copies are its weights and the one member's KV, as before
    assert one_step_s(link, None, [w, w], [0, k]) == pytest.approx(link.send_s(w + k))


async def _merge():
    """Two pairs form in a burst; then the cluster is asked to merge them as (0, 1, 2, 3), while
    long requests still run."""
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300,
                          policy=policy_path("kunserve_drop"))
    async with Cluster.start(config, instances=4, kind="inprocess") as cluster:
        groups = cluster.groups
        done = []
        with anyio.fail_after(300):  # virtual seconds: a lost request fails here
            async with anyio.create_task_group() as tg:
                start_burst(tg, cluster, done, 90, max_tokens=300)
                while len(groups.groups) < 2:  # (1, 0) and (2, 3)
                    await anyio.sleep(0.01)
                await anyio.sleep(0.5)  # the pairs serve a while
                before = {m: r for g in groups.groups.values()
                          for m, r in zip(g.members, g.layers)}
                await groups._form(GroupPlan(group_id=9, members=(0, 1, 2, 3), layers=FOUR))
        return ends_of(done), groups, before


def test_a_merge_waits_for_the_members_gained_layers_from_their_host_copies():
    ends, groups, before = trio.run(_merge, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(set(ends)) == [("length", 300)] and len(ends) == 90
    (four,) = [e for e in groups.counters.events if len(e["members"]) == 4]
    gained = gained_layers(GroupPlan(group_id=9, members=(0, 1, 2, 3), layers=FOUR), before)
    assert max(gained) == 8, before  # two members gain 8 layers each, in parallel
    per_layer = groups.model.block_bytes(16) * 209  # a Llama-3-8B layer in arena blocks
    expected = groups.host_link().send_s(8 * per_layer)  # 3.5 GB at 32 GB/s
    assert four["load_s"] == pytest.approx(expected) and 0.1 < expected < 0.12
    net = groups.instances[0].engine.backend.runner.network
    # the four's first grouped step waited for the loads (it began within the load, or the
    # step in flight at the merge ended first)
    assert net.load_waits and len(net.load_waits) == 1 and 0 < net.load_waits[0] <= expected
