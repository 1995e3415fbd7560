"""A running KunServe group of torch instance processes grows (shunter/cluster/remote_grow.py,
instance_grow.py, gpu/group_grow.py): three instance processes of a tiny 6-layer Llama, two
requests streaming on each; instances 0 and 1 form a group (layers 0-2 | 3-5), then instance 2
joins it while every request streams (0-1 | 2-3 | 4-5): its two requests move to the head, every
old member re-splits its KV, the pool grows. Every request goes on streaming across both changes
and its tokens equal transformers' greedy ones; once idle the group restores and every instance
serves alone with its own pool.

Groups are formed and grown by hand (the monitor's rules cannot fire: `waiting > 100`), so what
moves does not depend on the monitor's timing; the requests may run 200 tokens and are cancelled
once each went 3 tokens past the growth (none can end before it on its own). The growth waits
for the formation's exchange to settle (`settle_tries`); no assertion depends on how long.
Plants checked by hand (README, "KunServe ... torch"): the re-split not writing back the KV of
the layers a member keeps fails the token comparison.
"""

from __future__ import annotations

import random

import anyio
import pytest

import shunter
from engine.cluster.drop_plan import GroupPlan
from engine.cluster.plan import stage_layers
from shunter.cluster.cluster import Cluster
from tests.reference import assert_matches, greedy_reference

LAYERS = 6
SOLO_BLOCKS = 416
RUN_TOKENS = 800
"""6 + 800 tokens: 202 blocks of 4; two fit an instance's 416-block pool. A request must not
end before the test cancels it, and instance 2's run alone, a few ms a step, while the others
form a group (slow on a loaded host): with 80 one ended before the growth and the test waited
for its tokens; with 200 two of member 1's ended ('length') before the pair formed (the group
formed with `adopted=0`) in a full-suite run at load ~7; with 400 one of instance 2's had ended
before the growth (`[4, 0, 1] == [4, 0, 2]`) at load ~9. The tokens a test streams are bounded
by its time, not by this."""


@pytest.fixture(scope="module")
def grow_model(tmp_path_factory):
    from gpu.make_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("kunserve-grow-6l"), arch="llama",
                              layers=LAYERS, hidden=64, heads=4, kv_heads=2, vocab=320, seed=3)


@pytest.fixture(scope="module")
def grow_config(grow_model, tmp_path_factory):
    from engine.config import EngineConfig
    from policies import policy_path

    policy = tmp_path_factory.mktemp("kunserve-grow") / "kunserve_grow.policy"
    policy.write_text(f'policy kunserve_grow extends "{policy_path("fcfs")}" {{\n'
                      f'  dispatch round_robin\n'
                      f'  overload drop when waiting > 100\n'
                      f'  overload restore when waiting > 100\n}}\n')
    return EngineConfig(model=grow_model, device="cpu", threads=1, num_blocks=SOLO_BLOCKS,
                        block_size=4, cpu_swap_blocks=0, max_num_seqs=32, policy=policy)


@pytest.fixture(scope="module")
def grow_instances(grow_config):
    from shunter.cluster.launch import LocalLauncher

    launcher = LocalLauncher("asyncio")
    yield [launcher.start_process(i, grow_config) for i in range(3)]
    launcher.shutdown(timeout_s=0)


@pytest.mark.anyio
async def test_a_running_group_grows_while_requests_stream(
        anyio_backend, grow_config, grow_instances, grow_model):
    from shunter.cluster.remote_grow import grow

    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    rng = random.Random(21)
    prompts = [[rng.randrange(2, 320) for _ in range(6)] for _ in range(6)]
    got: dict[int, list[int]] = {i: [] for i in range(6)}
    scopes: dict[int, anyio.CancelScope] = {}

    async def one(i: int, started: anyio.Event) -> None:
        with anyio.CancelScope() as scopes[i]:
            async with cluster.generate(prompts[i], shunter.SamplingParams(
                    max_tokens=RUN_TOKENS, temperature=0)) as stream:
                async for chunk in stream:
                    assert chunk.error is None, (i, chunk.error)
                    got[i] += chunk.token_ids
                    if len(got[i]) >= 2:
                        started.set()

    async def past(marks: dict[int, int], extra: int = 3) -> None:
        while any(len(got[i]) < n + extra for i, n in marks.items()):
            await anyio.sleep(0.005)

    async with Cluster.start(grow_config, attach=grow_instances,
                             monitor_interval_s=0.02) as cluster:
        groups = cluster.groups
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                started = [anyio.Event() for _ in prompts]
                for i in range(6):  # round robin, one after the other: two on each instance
                    tg.start_soon(one, i, started[i])  # (dispatched at once, two could
                    await started[i].wait()  # take the same turn)
                assert [len(inst._live) for inst in cluster.instances] == [2, 2, 2]
                pair = GroupPlan(group_id=1, members=(0, 1), layers=stage_layers(LAYERS, 2))
                await groups.form(pair)
                await past({i: len(got[i]) for i in range(6)})
                marks = {i: len(got[i]) for i in range(6)}
                live = [len(inst._live) for inst in cluster.instances]
                assert live == [4, 0, 2], (live, groups.counters.events)
                grown = await grow(groups, pair, GroupPlan(
                    group_id=2, members=(0, 1, 2), layers=stage_layers(LAYERS, 3)))
                await past(marks)
                for scope in scopes.values():
                    scope.cancel()
            stats = await groups.stats(0)
            await cluster.wait_idle()
            assert await groups.restore(0)
            snap = await cluster.wait_idle()
            members = []
            with anyio.fail_after(30):  # each member's stats once it left the group
                for i in (1, 2):
                    while (await groups.stats(i))["member"] is None:
                        await anyio.sleep(0.01)
                    members.append((await groups.stats(i))["member"])
            after = await cluster.complete(prompts[0], shunter.SamplingParams(
                max_tokens=8, temperature=0))
    events = {e["event"]: e for e in groups.counters.events}
    print(f"\ngrow: {events['group']}; {events['grow']}; head {stats['head']['restore']}")
    assert grown.members == (0, 1, 2) and grown.layers == (range(2), range(2, 4), range(4, 6))
    g = events["grow"]
    assert g["adopted"] == 2 and g["adopted_with_kv"] == 2, g
    assert g["exchanging"] >= 4 and g["pool_blocks"] > events["group"]["pool_blocks"], g
    assert [s.scheduler.total_blocks for s in snap.snapshots] == [SOLO_BLOCKS] * 3
    # member 1 gains layer 2 (0-2 | 3-5 -> 0-1 | 2-3 | 4-5) from new member 2, not its host copy
    gained = members[0]["grown"]
    assert gained["weights_from_peer"] > 0 and gained["weights_restored"] == 0, gained
    assert members[1]["weights_sent"] == gained["weights_from_peer"], members
    # the kept KV (head: layers 0-1 of 0-2; member 1: layer 3 of 3-5) stays where it lies
    # where the new stride (2) divides the old block's place (stride 3), else it is copied
    # (gpu/kept_kv.py). The head's blocks all can: its solo blocks lie at even places, and
    # its block map hands out such blocks first; member 1 gains layer 2, whose weights may
    # come back over some of its blocks (how many depends on how many it mapped)
    assert g["kv_local_bytes"] > 0 and gained["kv_local"] > 0, (g, gained)
    assert g["kv_local_copied_bytes"] == 0, g
    assert gained["kv_local_copied"] <= gained["kv_local"], gained
    print(f"kept KV: head {g['kv_local_bytes']} B, {g['kv_local_copied_bytes']} B of it copied; "
          f"member 1 {gained['kv_local']} B, {gained['kv_local_copied']} B copied")
    for i, p in enumerate(prompts):
        assert len(got[i]) >= marks[i] + 3, (i, marks[i], got[i])
        assert_matches(got[i], greedy_reference(grow_model, p, len(got[i])), f"request {i}")
    assert_matches(after.token_ids, greedy_reference(grow_model, prompts[0], 8), "after")


def test_which_plans_grow_a_running_group():
    """The front door grows a running group only when the plan adds instances serving alone to
    exactly that group; the head stays, the new members come last, the layers split again. A
    plan holding two running groups whole merges them."""
    from shunter.cluster.remote_grow import grown_plan, grows, merges

    pair = GroupPlan(group_id=1, members=(1, 3), layers=stage_layers(LAYERS, 2))
    other = GroupPlan(group_id=2, members=(0, 2), layers=stage_layers(LAYERS, 2))
    merge = GroupPlan(group_id=3, members=(0, 1, 3), layers=stage_layers(LAYERS, 3))
    assert grows({1: pair}, merge) is pair
    assert grown_plan(pair, merge, LAYERS) == GroupPlan(
        group_id=3, members=(1, 3, 0), layers=(range(2), range(2, 4), range(4, 6)))
    both = GroupPlan(group_id=4, members=(0, 1, 2, 3), layers=stage_layers(LAYERS, 4))
    assert grows({1: pair, 0: other}, both) is None  # two running groups: merged instead
    assert merges({1: pair, 0: other}, both) == (other, pair)  # 0 leads the plan: its group
    bigger = GroupPlan(group_id=6, members=(1, 3, 4), layers=stage_layers(LAYERS, 3))
    alone = GroupPlan(group_id=7, members=(5, 0, 1, 2, 3, 4), layers=stage_layers(LAYERS, 6))
    assert merges({1: bigger, 0: other}, alone) == (bigger, other)  # else the larger stays
    assert merges({1: pair}, merge) is None and merges({1: pair, 0: other}, merge) is None
    part = GroupPlan(group_id=5, members=(1, 2), layers=stage_layers(LAYERS, 2))
    assert grows({1: pair}, part) is None  # a member of a running group taken alone


@pytest.mark.anyio
async def test_the_monitors_merge_with_a_running_group_grows_it(monkeypatch):
    """`RemoteGroups.act` on a drop whose plan merges a running group with an instance alone
    calls the growth (before: refused, the queue moved instead); one that merges two running
    groups calls the merge (the group whose head leads the plan stays)."""
    import shunter.cluster.remote_grow as rg
    from engine.cluster.overload import Drop
    from shunter.cluster.remote_groups import RemoteGroups

    grown, merged = [], []

    async def fake_grow(groups, old, g):
        grown.append((old.members, g.members))
        if 3 in g.members:
            raise rg.CannotGrow("instance 0: the grown group's pool is not larger")

    async def fake_merge(groups, stays, joins, g):
        merged.append((stays.members, joins.members, g.members))
        raise rg.Postponed("group (2, 3) does not fit its head's own pool yet")

    monkeypatch.setattr(rg, "grow", fake_grow)
    monkeypatch.setattr(rg, "merge", fake_merge)
    groups = RemoteGroups([], coordinator=None, base_pools=[8] * 4, num_layers=LAYERS)
    groups.instances = [type("I", (), {"alive": True, "moved_to": {}})() for _ in range(4)]
    pair = GroupPlan(group_id=1, members=(0, 1), layers=stage_layers(LAYERS, 2))
    other = GroupPlan(group_id=2, members=(2, 3), layers=stage_layers(LAYERS, 2))

    async def no_moves(stats):
        return None

    groups._reschedule_queued = no_moves
    groups.groups = {0: pair}
    merge = GroupPlan(group_id=3, members=(0, 1, 2), layers=stage_layers(LAYERS, 3))
    await groups.act(Drop(plan=None, new_groups=(merge,)), [None] * 4)
    assert grown == [((0, 1), (0, 1, 2))]
    groups.groups = {0: pair, 2: other}
    both = GroupPlan(group_id=4, members=(0, 1, 2, 3), layers=stage_layers(LAYERS, 4))
    await groups.act(Drop(plan=None, new_groups=(both,)), [None] * 4)
    assert grown == [((0, 1), (0, 1, 2))]
    assert merged == [((0, 1), (2, 3), (0, 1, 2, 3))], merged
    assert groups.counters.events[-1]["event"] == "merge postponed"  # asked again next round
    led_by_2 = GroupPlan(group_id=6, members=(2, 3, 0, 1), layers=stage_layers(LAYERS, 4))
    await groups.act(Drop(plan=None, new_groups=(led_by_2,)), [None] * 4)
    assert merged[-1] == ((2, 3), (0, 1), (2, 3, 0, 1)), merged
    # a split the head refused (its pool would not grow) is not asked again every round
    groups.groups = {0: pair}
    uneven = GroupPlan(group_id=5, members=(0, 1, 3), layers=stage_layers(LAYERS, 3))
    for _ in range(3):
        await groups.act(Drop(plan=None, new_groups=(uneven,)), [None] * 4)
    assert grown == [((0, 1), (0, 1, 2)), ((0, 1), (0, 1, 3))], grown
    assert [e["event"] for e in groups.counters.events[-3:]] == ["grow refused"] * 3


@pytest.mark.anyio
async def test_arrivals_taken_before_a_growth_is_watched_still_reach_the_scheduler():
    """One arrivals task per group: after a growth's re-split and before the scheduler's
    `Regroup` returns, the running task can take an arrival of the growth's exchange; it keeps
    it (`unclaimed`) and `watch_arrivals` sends it then (dropping it left the request waiting for
    its KV for good)."""
    import types

    from engine.messages import SwapDone
    from shunter.cluster.instance_groups import InstanceGroups

    sent = []
    batches = [[1, 5], [], [], [], [], []]

    class Group:
        ranks = (0, 1)

        def arrived(self):
            return batches.pop(0) if batches else []

        def poll(self, step_id):
            return self.arrived()

    class Thread:
        async def run(self, fn, *args):
            return fn(*args)

    class Send:
        async def send(self, msg):
            sent.append(msg)

    runner = types.SimpleNamespace(group=Group(), _thread=Thread())
    engine = types.SimpleNamespace(backend=types.SimpleNamespace(runner=runner),
                                   _scheduler_send=Send())
    ig = InstanceGroups(engine, server=None)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await ig.watch_arrivals({1, 2}, tg)  # the forming's requests
            while not sent:  # the task took [1, 5] (5: the growth's, not watched yet)
                await anyio.sleep(0.001)
            await ig.watch_arrivals({5}, tg)  # the growth's, once the scheduler marked it
            await anyio.sleep(0.02)
            runner.group = None  # the group restores: the task leaves
    done = sorted(r for m in sent if isinstance(m, SwapDone) for r in m.request_ids)
    assert done == [1, 5], sent


def test_a_group_still_exchanging_is_not_settled():
    """Requests whose KV still moves (waiting for chunks somewhere, or adopted and never set
    up: their KV is in staging or reserved on their owner) hold a growth back; ended ones, and
    ones set up and since released to be recomputed (under memory pressure: no KV), do not."""
    import types

    from gpu.group_grow import unsettled

    group = types.SimpleNamespace(
        exchanging=lambda: {3}, stage=types.SimpleNamespace(seqs={1: None, 2: None}),
        adopted=tuple(types.SimpleNamespace(request_id=r) for r in (2, 4, 5, 6)), set_up={6})
    assert unsettled(group, None) == {3, 4, 5}  # 6: set up, then released to be recomputed
    assert unsettled(group, [1, 2, 3, 4, 6]) == {3, 4}  # 5 ended before it was set up


@pytest.mark.anyio
async def test_a_growth_that_never_settles_lets_the_new_member_go_and_recomputes_its_requests(
        monkeypatch):
    """The head waits for its group's last exchange to settle; when it does not in time, the
    new member is let go (`GroupAbandon`, it serves alone with nothing dropped), the requests it
    handed over are recomputed at the head and the group goes on as it was; the front door
    gets the error."""
    import types

    import gpu.group_runner as gr
    import shunter.cluster.instance_grow as ig_mod
    from gpu.group_grow import NotSettled
    from shunter.cluster.group_wire import GrowGroup
    from shunter.cluster.instance_groups import GroupNotFormed, InstanceGroups

    monkeypatch.setattr(ig_mod, "SETTLE_S", 0.05)
    abandoned, recomputed, tries = [], [], []

    class Thread:
        async def run(self, fn, *args):
            return fn(*args)

    def grow(plan, adopted, live):
        tries.append(live)
        raise NotSettled("requests [7] still wait for the group's last KV exchange")

    runner = types.SimpleNamespace(group=types.SimpleNamespace(ranks=(0, 1)), _thread=Thread(),
                                   grow=grow)

    async def inspect():
        return types.SimpleNamespace(scheduler=types.SimpleNamespace(live_requests=(7, 9)))

    q = types.SimpleNamespace(id=9, computed_tokens=12, state="running")

    class Groups:
        engine = types.SimpleNamespace(inspect=inspect, backend=None)

        _adopt = InstanceGroups._adopt

        async def _take_over(self, moved):
            return [(3, q)]

        async def _recompute_here(self, adopted, reqs):
            recomputed.extend(reqs)
            return len(reqs)

    ig = Groups()
    ig.runner = runner
    monkeypatch.setattr(gr, "abandon_members",
                        lambda ranks, lost, why: abandoned.append((tuple(ranks), why)))
    plan = GroupPlan(group_id=2, members=(0, 1, 2), layers=stage_layers(LAYERS, 3))
    msg = GrowGroup(key=1, plan=plan, adopted=((2, "moved"),))
    with pytest.raises(GroupNotFormed, match=r"did not grow to \(0, 1, 2\) \(requests \[7\] "
                       r"still wait.*the 1 requests handed over are recomputed at instance 0"):
        await ig_mod.grow_here(ig, msg, None)
    assert len(tries) >= 2 and tries[0] == (7, 9), tries  # retried, with the live requests
    assert abandoned == [((2,), "requests [7] still wait for the group's last KV exchange")]
    assert recomputed == [q]

