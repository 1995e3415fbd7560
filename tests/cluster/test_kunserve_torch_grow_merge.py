"""Two running KunServe groups of torch instance processes merge (shunter/cluster/remote_grow.py
`merge`): four instances of a tiny 8-layer Llama (shared by both tests), two requests streaming
on each; instances 0 and 1 form a group (0-3 | 4-7), instances 2 and 3 another; then the plan
merges them into (0, 1, 2, 3) (0-1 | 2-3 | 4-5 | 6-7), two ways:

- directly (gpu/group_merge.py): instance 2 hands its four requests over to instance 0 and tells
  instance 3 its new head; instance 2 sends their layers 0-1 and 2-3 to instances 0 and 1,
  instance 3 sends 4-5 to instance 2 and keeps 6-7: each byte of that KV moves once at most
  (6 of its 8 layers here, counted by the head and by the members);
- restore then grow (`direct=False`): group (2, 3) restores (instance 2 takes its layers and
  its four requests' KV back), then joins as instances serving alone do (instance 2 hands its
  requests over with their KV, instance 3 joins empty): that KV moves twice. The direct test
  compares the two (bytes moved over the joining group's KV) when both ran in one session.

Every request goes on streaming across the changes and its tokens equal transformers' greedy
ones; once idle the merged group restores and every instance serves alone with its own pool.
Groups are formed and merged by hand (the monitor's rules cannot fire), as in
test_kunserve_torch_grow.py; requests are cancelled once each went 3 tokens past the merge.
The restore path's order (restore, then the joining instances hand over only once its head's
runner is alone) is checked with a stand-in front door (plant: no wait for the restore fails it).
"""

from __future__ import annotations

import random

import anyio
import attrs
import pytest

import shunter
from engine.cluster.drop_plan import GroupPlan
from engine.cluster.plan import stage_layers
from shunter.cluster.cluster import Cluster
from tests.cluster.test_kunserve_torch_grow_faults import Streams, _references
from tests.reference import Reference, assert_matches, greedy_reference

LAYERS = 8
RUN_TOKENS = 160
"""None ends by itself before the merge, however the load stretches the steps between the
changes (with 80 one did, under load 9)."""
SOLO_BLOCKS = 192
"""Two requests of at most 6 + 160 tokens (42 blocks each) per instance, and the four of the
joining group at its head when it restores: they always fit."""


@pytest.fixture(scope="module")
def merge_model(tmp_path_factory):
    from gpu.make_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("kunserve-merge-8l"), arch="llama",
                              layers=LAYERS, hidden=64, heads=4, kv_heads=2, vocab=320, seed=5)


@pytest.fixture(scope="module")
def merge_config(merge_model, tmp_path_factory):
    from engine.config import EngineConfig
    from policies import policy_path

    policy = tmp_path_factory.mktemp("kunserve-merge") / "kunserve_merge.policy"
    policy.write_text(f'policy kunserve_merge extends "{policy_path("fcfs")}" {{\n'
                      f'  dispatch round_robin\n'
                      f'  overload drop when waiting > 100\n'
                      f'  overload restore when waiting > 100\n}}\n')
    return EngineConfig(model=merge_model, device="cpu", threads=1, num_blocks=SOLO_BLOCKS,
                        block_size=4, cpu_swap_blocks=0, max_num_seqs=32, policy=policy)


SEEDED = 3
"""This request samples with a seed (it starts on instance 3, the joining group's last stage,
which samples in both groups); after the final restore the same request alone on an instance
must draw the same tokens. Restoring first, the joining head owns it as it joins and is not
the last stage: its generator's state goes there (gpu/group_gens.py; before, it restarted)."""
SEEDED_PARAMS = shunter.SamplingParams(max_tokens=RUN_TOKENS, temperature=1.0, seed=4321,
                                       ignore_eos=True)


class SeededStreams(Streams):
    async def _one(self, i: int, started: anyio.Event) -> None:
        if i != SEEDED:
            return await super()._one(i, started)
        with anyio.CancelScope() as self.scopes[i]:
            async with self.cluster.generate(self.prompts[i], SEEDED_PARAMS) as stream:
                async for chunk in stream:
                    assert chunk.error is None, (i, chunk.error)
                    self.got[i] += chunk.token_ids
                    if len(self.got[i]) >= 2:
                        started.set()


@pytest.fixture(scope="module")
def merge_instances(merge_config):
    """Four instance processes, shared by both merges (each test attaches its own cluster)."""
    from shunter.cluster.launch import LocalLauncher

    launcher = LocalLauncher("asyncio")
    yield [launcher.start_process(i, merge_config) for i in range(4)]
    launcher.shutdown(timeout_s=0)


PAST_DIRECT = 16
"""Tokens each request goes past the direct merge: its KV moved there is read by them all (with
3, a member sending one transfer of zeros was not seen: this tiny random model's greedy tokens
loop, and few depend on old KV)."""
MOVED: dict[str, float] = {}
"""Each path's bytes of the joining group's KV moved over all of it (its every layer at the
merge): the direct test compares them when both ran in one session."""


async def _merge_while_streaming(config, instances, model, *, direct: bool, seed: int,
                                 past: int = 3) -> dict:
    """Groups (0, 1) and (2, 3) form with two requests streaming on each instance, then merge
    (`direct` or restore-then-grow); every request goes 3 tokens past the merge and is
    cancelled; the merged group restores; a new request is served. Returns what happened."""
    from shunter.cluster.remote_grow import merge

    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 320) for _ in range(6)] for _ in range(8)]
    halves = stage_layers(LAYERS, 2)
    a = GroupPlan(group_id=1, members=(0, 1), layers=halves)
    b = GroupPlan(group_id=2, members=(2, 3), layers=halves)
    out: dict = {"prompts": prompts}
    async with Cluster.start(config, attach=instances, monitor_interval_s=0.02) as cluster:
        groups, run = cluster.groups, SeededStreams(cluster, prompts, RUN_TOKENS)
        with anyio.fail_after(240):
            async with anyio.create_task_group() as tg:
                await run.start(tg)
                assert [len(i._live) for i in cluster.instances] == [2] * 4
                await groups.form(a)
                await groups.form(b)
                await run.past(run.marks())
                assert [len(i._live) for i in cluster.instances] == [4, 0, 4, 0]
                out["joining_restore"] = None
                merged = await merge(groups, a, b, GroupPlan(
                    group_id=3, members=(0, 1, 2, 3), layers=stage_layers(LAYERS, 4)),
                    direct=direct)
                live = [len(i._live) for i in cluster.instances]
                assert live == [8, 0, 0, 0], (live, run.marks(), groups.counters.events)
                marks = run.marks()
                await run.past(marks, past)
                run.cancel()
            if not direct:  # the joining group's restore: its members' KV back to its head
                out["joining_head"] = (await groups.stats(2))["head"]
                out["joining_restore"] = out["joining_head"]["restore"]
            await cluster.wait_idle()
            assert await groups.restore(0)
            out["snap"] = await cluster.wait_idle()
            out["members"] = {}
            for m in (1, 2, 3):  # their counters, once their loops returned
                while not (st := (await groups.stats(m))["member"]):  # (None while serving)
                    await anyio.sleep(0.01)
                out["members"][m] = st
            out["head_sent"] = (await groups.stats(0))["head"]["sent_bytes"]
            out["kv_exchanged"] = groups.report(0.0)["kv_exchanged_bytes"]
            out["after"] = await cluster.complete(prompts[0], shunter.SamplingParams(
                max_tokens=8, temperature=0))
            out["seeded_alone"] = (await cluster.complete(prompts[SEEDED], attrs.evolve(
                SEEDED_PARAMS, max_tokens=len(run.got[SEEDED])))).token_ids
    out.update(merged=merged, marks=marks, got=run.got, events=groups.counters.events, past=past)
    return out


def _check_outputs(out: dict, model) -> None:
    merged, events, snap = out["merged"], out["events"], out["snap"]
    assert merged.members == (0, 1, 2, 3) and merged.layers == stage_layers(LAYERS, 4)
    g = next(e for e in events if e["event"] == "grow")
    assert g["adopted"] == 4 and g["adopted_with_kv"] == 4, g  # instance 2's, with their KV
    formed = next(e for e in events if e["event"] == "group")
    assert g["pool_blocks"] > formed["pool_blocks"], (g, formed)
    assert [s.scheduler.total_blocks for s in snap.snapshots] == [SOLO_BLOCKS] * 4
    assert [s.scheduler.free_blocks for s in snap.snapshots] == [SOLO_BLOCKS] * 4
    refs = _references(model, out["prompts"], max(len(g) for g in out["got"].values()))
    for i in range(8):
        if i == SEEDED:
            continue
        assert len(out["got"][i]) >= out["marks"][i] + out["past"], (i, out["marks"][i],
                                                                     out["got"][i])
        got = out["got"][i]
        assert_matches(got, Reference(tokens=refs[i].tokens[:len(got)],
                                      top2=refs[i].top2[:len(got)]), f"request {i}")
    assert_matches(out["after"].token_ids, greedy_reference(model, out["prompts"][0], 8),
                   "after")


def _check_kv_exchanged(out: dict, before: int) -> None:
    """The cluster's `kv_exchanged_bytes` (each head's count of every member's transfers
    and of what it received restoring: gpu/kv_moved.py) equals what every instance sent by its
    own counters: instance 0's as the head (forming, growing), 1's, 2's and 3's as members of
    the merged group (restoring too), 2's and 3's in group (2, 3) before a direct merge
    (`sent_before_bytes`), and `before` (in group (2, 3) before it restored). Member-to-member
    sends are among them (2 to 1, 3 to 2 as the groups merge)."""
    members = out["members"]
    sent = out["head_sent"] + before + sum(members[m]["sent_bytes"]
                                           + members[m]["sent_before_bytes"] for m in (1, 2, 3))
    assert out["kv_exchanged"] == sent > 0, (out["kv_exchanged"], out["head_sent"], before,
                                             members)


@pytest.mark.anyio
async def test_two_running_groups_merge_after_the_joining_one_restores(
        anyio_backend, merge_config, merge_instances, merge_model):
    """Restore-then-grow (`direct=False`): instance 2 takes its group's layers and KV back,
    then joins with its four requests as an instance serving alone does."""
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    out = await _merge_while_streaming(merge_config, merge_instances, merge_model,
                                       direct=False, seed=31)
    events = out["events"]
    print(f"\nmerge (restore first): {[e for e in events if e['event'] in ('restore', 'grow')]}")
    kinds = [e["event"] for e in events]
    assert kinds == ["group", "group", "restore", "grow", "merge", "restore"], kinds
    _check_outputs(out, merge_model)
    g = next(e for e in events if e["event"] == "grow")
    got = out["got"][SEEDED]  # the joining head owns it as it joins, instance 3 samples it
    assert got == list(out["seeded_alone"]), (out["marks"][SEEDED], got, out["seeded_alone"])
    restored = out["joining_restore"]["kv_bytes"]
    assert restored > 0 and g["kv_adopted_bytes"] > 0, (out["joining_restore"], g)
    MOVED["restore_then_grow"] = (restored + g["kv_adopted_bytes"]) / g["kv_adopted_held_bytes"]
    b = out["joining_head"]  # group (2, 3): 2 sent as its head, received all 3 sent in it
    _check_kv_exchanged(out, b["sent_bytes"] + b["received_bytes"])


@pytest.mark.anyio
async def test_two_running_groups_merge_directly(anyio_backend, merge_config, merge_instances,
                                                 merge_model):
    """Direct (gpu/group_merge.py): the joining group's members send the layers of its requests'
    KV that others keep now (0-1 and 2-3 from instance 2, 4-5 from instance 3; instance 3 keeps
    6-7): each byte moves once at most, 6 of 8 layers here."""
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    out = await _merge_while_streaming(merge_config, merge_instances, merge_model,
                                       direct=True, seed=37, past=PAST_DIRECT)
    events = out["events"]
    g = next(e for e in events if e["event"] == "grow")
    print(f"\nmerge (direct): {g}; members {out['members']}")
    kinds = [e["event"] for e in events]
    assert kinds == ["group", "group", "grow", "merge", "restore"], kinds
    _check_outputs(out, merge_model)
    got = out["got"][SEEDED]  # instance 3's: its generator crossed both groups and the merge
    assert got == list(out["seeded_alone"]), (out["marks"][SEEDED], got, out["seeded_alone"])
    moved, held = g["kv_adopted_bytes"], g["kv_adopted_held_bytes"]
    assert moved * LAYERS == held * 6, g  # layers 0-5 moved, 6-7 stayed on instance 3
    merged = {m: out["members"][m]["merged"] for m in (2, 3)}
    assert merged[2]["kv_kept"] == 0 and merged[3]["kv_kept"] * LAYERS == held * 2, merged
    assert merged[2]["kv_sent"] + merged[3]["kv_sent"] == moved, (merged, g)
    assert merged[2]["kv_sent"] == 2 * merged[3]["kv_sent"], merged  # 4 layers to 2
    assert all(out["members"][m]["copied_blocks"] == 0 for m in (2, 3)), out["members"]
    _check_kv_exchanged(out, 0)
    MOVED["direct"] = moved / held
    if "restore_then_grow" in MOVED:  # both ran in this session
        ratio = MOVED["direct"] / MOVED["restore_then_grow"]
        print(f"moved per byte of the joining group's KV: direct {MOVED['direct']:.3f}, "
              f"restore then grow {MOVED['restore_then_grow']:.3f} (ratio {ratio:.3f})")
        assert MOVED["direct"] <= 1.0 < MOVED["restore_then_grow"], MOVED


@pytest.mark.anyio
async def test_a_merge_restores_the_joining_group_before_its_instances_join(monkeypatch):
    """`merge` (stand-in front door): the head's check first, then the joining group restores,
    and its instances are asked to hand their requests over only once its head's runner is
    alone (its next step restores: `leading` goes False); a restore that does not fit yet
    postpones the merge with nothing moved; a head that never restores fails it by name."""
    import types

    import shunter.cluster.remote_grow as rg
    from engine.cluster.counters import ClusterCounters
    from shunter.cluster.group_wire import GrowGroup
    from shunter.cluster.remote_groups import GroupCommandError

    stays = GroupPlan(group_id=1, members=(0, 1), layers=stage_layers(LAYERS, 2))
    joins = GroupPlan(group_id=2, members=(2, 3), layers=stage_layers(LAYERS, 2))
    plan = GroupPlan(group_id=3, members=(0, 1, 2, 3), layers=stage_layers(LAYERS, 4))

    class Groups:
        num_layers = LAYERS

        def __init__(self, fits=True, steps_to_restore=3):
            self.calls, self.fits, self.leading = [], fits, None
            self.steps = steps_to_restore
            self.groups, self.counters = {0: stays, 2: joins}, ClusterCounters()
            self.coordinator = types.SimpleNamespace(send=self._sent)
            self.instances = [types.SimpleNamespace(alive=True, failure=None)] * 4

        async def _sent(self, msg):
            pass

        async def _command(self, head, make):
            msg = make(0)
            self.calls.append(("check" if isinstance(msg, GrowGroup) and msg.check
                               else type(msg).__name__, head))
            return {"pool_blocks": 9}

        async def restore(self, head):
            self.calls.append(("restore", head))
            if self.fits:
                self.leading = self.steps
            return self.fits

        async def stats(self, head):
            if self.leading:  # each look: one more step ran; the restore comes with one
                self.leading -= 1
            return {"head": {"leading": bool(self.leading)}}

        async def _export(self, head, m):
            self.calls.append(("export", m, bool(self.leading)))
            return ()

        async def note_kv(self, head):
            pass

    g = Groups()
    assert (await rg.merge(g, stays, joins, plan, direct=False)).members == (0, 1, 2, 3)
    assert g.calls[:2] == [("check", 0), ("restore", 2)], g.calls
    exports = [c for c in g.calls if c[0] == "export"]
    assert exports == [("export", 2, False), ("export", 3, False)], g.calls
    assert g.counters.events[-1]["event"] == "merge", g.counters.events
    g = Groups(fits=False)
    with pytest.raises(rg.Postponed, match=r"group \(2, 3\) does not fit"):
        await rg.merge(g, stays, joins, plan, direct=False)
    assert g.calls == [("check", 0), ("restore", 2)], g.calls
    monkeypatch.setattr(rg, "RESTORED_S", 0.05)
    g = Groups(steps_to_restore=10**9)
    with pytest.raises(GroupCommandError, match=r"instance 2: its group \(2, 3\) had not restored"):
        await rg.merge(g, stays, joins, plan, direct=False)
    assert not [c for c in g.calls if c[0] == "export"], g.calls


@pytest.mark.anyio
async def test_a_direct_merge_hands_the_joining_group_over():
    """`merge` directly (stand-in front door): the head's check, then the joining head's
    `HandOverGroup`, then the staying head's `MergeGroup` naming where each layer of the
    handed-over requests lies; their streams follow them. A joining head that refuses
    (its last exchange still running) postpones the merge with nothing else asked; a plan
    that also adds an instance serving alone takes the restore path."""
    import types

    import shunter.cluster.remote_grow as rg
    from engine.cluster.counters import ClusterCounters
    from shunter.cluster.group_wire import GrowGroup
    from shunter.cluster.instance_grow import HandOverGroup, MergeGroup
    from shunter.cluster.remote_groups import GroupCommandError

    stays = GroupPlan(group_id=1, members=(0, 1), layers=stage_layers(LAYERS, 2))
    joins = GroupPlan(group_id=2, members=(2, 3), layers=stage_layers(LAYERS, 2))
    plan = GroupPlan(group_id=3, members=(0, 1, 2, 3), layers=stage_layers(LAYERS, 4))
    moved = tuple(types.SimpleNamespace(cluster_key=k) for k in (11, 12))

    class Groups:
        num_layers = LAYERS

        def __init__(self, refuse=False):
            self.calls, self.refuse, self.sent = [], refuse, []
            self.groups, self.counters = {0: stays, 2: joins}, ClusterCounters()
            self.coordinator = types.SimpleNamespace(send=self._sent)
            self.instances = [types.SimpleNamespace(alive=True, failure=None, _live={},
                                                    moved_to={}) for _ in range(5)]
            self.instances[2]._live = {11: "a", 12: "b"}

        async def _sent(self, msg):
            self.sent.append(msg)

        async def _command(self, head, make):
            msg = make(0)
            self.calls.append((type(msg).__name__, head))
            if isinstance(msg, HandOverGroup):
                if self.refuse:
                    raise GroupCommandError(f"instance {head}: not settled")
                return moved
            if isinstance(msg, MergeGroup):
                self.merge_msg = msg
            return {"pool_blocks": 9} if isinstance(msg, GrowGroup) else None

        async def restore(self, head):
            self.calls.append(("restore", head))
            return False

        async def note_kv(self, head):
            pass

    g = Groups()
    assert (await rg.merge(g, stays, joins, plan)).members == (0, 1, 2, 3)
    assert g.calls == [("GrowGroup", 0), ("HandOverGroup", 2), ("MergeGroup", 0)], g.calls
    m = g.merge_msg
    assert m.parts == ((2, range(0, 4)), (3, range(4, 8))), m.parts  # member 2 and 3's layers
    assert [k for k, _ in m.adopted] == [2, 2] and m.plan.layers == stage_layers(LAYERS, 4)
    assert g.instances[0]._live == {11: "a", 12: "b"} and not g.instances[2]._live
    assert g.groups == {0: m.plan}, g.groups
    assert g.counters.events[-1]["event"] == "merge" and g.counters.events[-1]["direct"]
    g = Groups(refuse=True)
    with pytest.raises(rg.Postponed, match="not settled"):
        await rg.merge(g, stays, joins, plan)
    assert g.calls == [("GrowGroup", 0), ("HandOverGroup", 2)], g.calls
    assert g.groups == {0: stays, 2: joins} and g.instances[2]._live, g.groups
    g = Groups()
    with pytest.raises(rg.Postponed):  # (the stand-in's restore does not fit)
        await rg.merge(g, stays, joins, GroupPlan(group_id=3, members=(0, 1, 2, 3, 4),
                                                  layers=stage_layers(LAYERS, 5)))
    assert ("restore", 2) in g.calls and ("HandOverGroup", 2) not in g.calls, g.calls
