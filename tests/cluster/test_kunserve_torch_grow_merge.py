"""Two running KunServe groups of torch instance processes merge (shunter/cluster/remote_grow.py
`merge`), with an instance serving alone: five instances of a tiny 8-layer Llama (shared by
both tests), two requests streaming on each; instances 0 and 1 form a group (0-3 | 4-7),
instances 2 and 3 another; instance 4 serves alone; then the plan merges them all, two ways:

- directly (gpu/group_merge.py) into (0, 1, 4, 2, 3) (0-1 | 2-3 | 4-5 | 6 | 7): instance 4
  hands its requests over as in a growth, instance 2 hands its four over to instance 0 and
  tells instance 3 its new head; instance 2 sends their layers 0-1 and 2-3 to instances 0 and
  1, instance 3 sends 4-5 to instance 4 and 6 to instance 2 and keeps 7: each byte of that KV
  moves once at most (7 of its 8 layers here, counted by the head and by the members);
- restore then grow (`direct=False`) into (0, 1, 2, 3, 4): group (2, 3) restores (instance 2
  takes its layers and its four requests' KV back), then its instances join as instance 4
  does (instance 2 hands its requests over with their KV, instance 3 joins empty): that KV
  moves twice. The direct test compares the two (bytes moved over the joining group's KV)
  when both ran in one session.

Every request goes on streaming across the changes and its tokens equal transformers' greedy
ones; once idle the merged group restores and every instance serves alone with its own pool.
Groups are formed and merged by hand (the monitor's rules cannot fire), as in
test_kunserve_torch_grow.py; requests are cancelled once each went 3 tokens past the merge.
The order of the commands on both paths is checked with a stand-in front door
(test_kunserve_torch_merge_standins.py).
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
RUN_TOKENS = 400
"""None ends by itself before the merge, however the load stretches the steps between the
changes (with 80 one did, under load 9; with 160, one in a fault test under load 8, and the
test waited for its tokens; `Streams.past` now fails at once on a request that ended)."""
SOLO_BLOCKS = 416
"""Two requests of at most 6 + 400 tokens (102 blocks each) per instance, and the four of the
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


SEEDED = (3, 4)
"""These requests sample with a seed; after the final restore each alone on an instance must
draw the same tokens. Request 3 starts on instance 3, the joining group's last stage, which
samples in both groups and, merged directly, in the merged one; restoring first, the joining
head owns it as it joins and is not the last stage (instance 4 is): its generator's state goes
there (gpu/group_gens.py; before, it restarted). Request 4 starts on instance 4 alone: merged
directly, its state goes to instance 3 (a `MergeStage`: gpu/group_merge.py)."""
SEEDED_PARAMS = shunter.SamplingParams(max_tokens=RUN_TOKENS, temperature=1.0, seed=4321,
                                       ignore_eos=True)


class SeededStreams(Streams):
    async def _one(self, i: int, started: anyio.Event) -> None:
        if i not in SEEDED:
            return await super()._one(i, started)
        with anyio.CancelScope() as self.scopes[i]:
            async with self.cluster.generate(self.prompts[i], SEEDED_PARAMS) as stream:
                async for chunk in stream:
                    assert chunk.error is None, (i, chunk.error)
                    self.got[i] += chunk.token_ids
                    if len(self.got[i]) >= 2:
                        started.set()
                    if chunk.finish_reason is not None:
                        self.ended[i] = chunk.finish_reason


@pytest.fixture(scope="module")
def merge_instances(merge_config):
    """Five instance processes, shared by both merges (each test attaches its own cluster)."""
    from shunter.cluster.launch import LocalLauncher

    launcher = LocalLauncher("asyncio")
    yield [launcher.start_process(i, merge_config) for i in range(5)]
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
    with instance 4 (`direct` or restore-then-grow); every request goes `past` the merge and is
    cancelled; the merged group restores; a new request is served. Returns what happened."""
    from shunter.cluster.remote_grow import merge

    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 320) for _ in range(6)] for _ in range(10)]
    halves = stage_layers(LAYERS, 2)
    a = GroupPlan(group_id=1, members=(0, 1), layers=halves)
    b = GroupPlan(group_id=2, members=(2, 3), layers=halves)
    out: dict = {"prompts": prompts}
    async with Cluster.start(config, attach=instances, monitor_interval_s=0.02) as cluster:
        groups, run = cluster.groups, SeededStreams(cluster, prompts, RUN_TOKENS)
        with anyio.fail_after(240):
            async with anyio.create_task_group() as tg:
                await run.start(tg)
                assert [len(i._live) for i in cluster.instances] == [2] * 5
                await groups.form(a)
                await groups.form(b)
                await run.past(run.marks())
                assert [len(i._live) for i in cluster.instances] == [4, 0, 4, 0, 2]
                out["joining_restore"] = None
                merged = await merge(groups, a, b, GroupPlan(
                    group_id=3, members=(0, 1, 2, 3, 4), layers=stage_layers(LAYERS, 5)),
                    direct=direct)
                live = [len(i._live) for i in cluster.instances]
                assert live == [10, 0, 0, 0, 0], (live, run.marks(), groups.counters.events)
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
            for m in (1, 2, 3, 4):  # their counters, once their loops returned
                while not (st := (await groups.stats(m))["member"]):  # (None while serving)
                    await anyio.sleep(0.01)
                out["members"][m] = st
            out["head_sent"] = (await groups.stats(0))["head"]["sent_bytes"]
            out["kv_exchanged"] = groups.report(0.0)["kv_exchanged_bytes"]
            out["after"] = await cluster.complete(prompts[0], shunter.SamplingParams(
                max_tokens=8, temperature=0))
            out["seeded_alone"] = {i: (await cluster.complete(prompts[i], attrs.evolve(
                SEEDED_PARAMS, max_tokens=len(run.got[i])))).token_ids for i in SEEDED}
    out.update(merged=merged, marks=marks, got=run.got, events=groups.counters.events, past=past)
    return out


def _check_outputs(out: dict, model, members: tuple[int, ...]) -> None:
    merged, events, snap = out["merged"], out["events"], out["snap"]
    assert merged.members == members and merged.layers == stage_layers(LAYERS, 5)
    g = next(e for e in events if e["event"] == "grow")
    assert g["adopted"] == 6 and g["adopted_with_kv"] == 6, g  # instance 2's and 4's, with KV
    formed = next(e for e in events if e["event"] == "group")
    assert g["pool_blocks"] > formed["pool_blocks"], (g, formed)
    # the head keeps layers 0-1 of the 0-3 it held: their KV stays where it lies (strides 4 -> 2)
    assert g["kv_local_bytes"] > 0 and g["kv_local_copied_bytes"] == 0, g
    assert [s.scheduler.total_blocks for s in snap.snapshots] == [SOLO_BLOCKS] * 5
    assert [s.scheduler.free_blocks for s in snap.snapshots] == [SOLO_BLOCKS] * 5
    for i in SEEDED:
        got = out["got"][i]
        assert got == list(out["seeded_alone"][i]), (i, out["marks"][i], got,
                                                     out["seeded_alone"][i])
    refs = _references(model, out["prompts"], max(len(g) for g in out["got"].values()))
    for i in range(10):
        if i in SEEDED:
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
    own counters: instance 0's as the head (forming, growing), 1's to 4's as members of the
    merged group (restoring too), 2's and 3's in group (2, 3) before a direct merge
    (`sent_before_bytes`), and `before` (in group (2, 3) before it restored). Member-to-member
    sends are among them (2 to 1, 3 to 2 as the groups merge)."""
    members = out["members"]
    sent = out["head_sent"] + before + sum(members[m]["sent_bytes"]
                                           + members[m]["sent_before_bytes"] for m in (1, 2, 3, 4))
    assert out["kv_exchanged"] == sent > 0, (out["kv_exchanged"], out["head_sent"], before,
                                             members)


@pytest.mark.anyio
async def test_two_running_groups_merge_after_the_joining_one_restores(
        anyio_backend, merge_config, merge_instances, merge_model):
    """Restore-then-grow (`direct=False`): instance 2 takes its group's layers and KV back,
    then joins with its four requests as instance 4 (serving alone) does."""
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    out = await _merge_while_streaming(merge_config, merge_instances, merge_model,
                                       direct=False, seed=31)
    events = out["events"]
    print(f"\nmerge (restore first): {[e for e in events if e['event'] in ('restore', 'grow')]}")
    kinds = [e["event"] for e in events]
    assert kinds == ["group", "group", "restore", "grow", "merge", "restore"], kinds
    _check_outputs(out, merge_model, (0, 1, 2, 3, 4))
    g = next(e for e in events if e["event"] == "grow")
    restored = out["joining_restore"]["kv_bytes"]
    moved = out["members"][2]["sent_bytes"]  # group (2, 3)'s KV from instance 2 (keeps 4-5)
    alone = out["members"][4]["sent_bytes"]  # instance 4's (it keeps 7)
    assert restored > 0 and moved > 0 and g["kv_adopted_bytes"] == moved + alone, (restored, g)
    assert g["kv_adopted_held_bytes"] * 42 == moved * 56 + alone * 48, g  # 6/8 and 7/8 moved
    MOVED["restore_then_grow"] = (restored + moved) * 6 / (moved * LAYERS)
    b = out["joining_head"]  # group (2, 3): 2 sent as its head, received all 3 sent in it
    _check_kv_exchanged(out, b["sent_bytes"] + b["received_bytes"])


@pytest.mark.anyio
async def test_two_running_groups_merge_directly(anyio_backend, merge_config, merge_instances,
                                                 merge_model):
    """Direct (gpu/group_merge.py): the joining group's members send the layers of its requests'
    KV that others keep now (0-1 and 2-3 from instance 2, 4-5 and 6 from instance 3; instance 3
    keeps 7): each byte moves once at most, 7 of 8 layers here. Instance 4 (alone) joins as in
    a growth, before the joining instances."""
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    out = await _merge_while_streaming(merge_config, merge_instances, merge_model,
                                       direct=True, seed=37, past=PAST_DIRECT)
    events = out["events"]
    g = next(e for e in events if e["event"] == "grow")
    print(f"\nmerge (direct): {g}; members {out['members']}")
    kinds = [e["event"] for e in events]
    assert kinds == ["group", "group", "grow", "merge", "restore"], kinds
    _check_outputs(out, merge_model, (0, 1, 4, 2, 3))
    merged = {m: out["members"][m]["merged"] for m in (2, 3)}
    moved = merged[2]["kv_sent"] + merged[3]["kv_sent"]  # group (2, 3)'s KV that moved
    held = merged[3]["kv_kept"] * LAYERS  # instance 3 kept its layer 7
    assert merged[2]["kv_kept"] == 0 and moved * LAYERS == held * 7 > 0, merged
    assert 3 * merged[2]["kv_sent"] == 4 * merged[3]["kv_sent"], merged  # 4 layers to 3
    alone = out["members"][4]["sent_bytes"]  # instance 4's requests: it keeps 4-5
    assert g["kv_adopted_bytes"] == moved + alone, (merged, alone, g)
    assert (g["kv_adopted_held_bytes"] - held) * 6 == alone * LAYERS, (held, alone, g)
    assert all(out["members"][m]["copied_blocks"] == 0 for m in (2, 3)), out["members"]
    # instance 3's layer 7 of them stays where it lay (strides 4 -> 1): no copy (before
    # gpu/kept_kv.py all of `kv_kept` went to the host and back)
    assert merged[3]["kv_kept_copied"] == 0, merged
    print(f"kept KV not moved: instance 3 {merged[3]['kv_kept']} B of the joining requests, "
          f"the head {g['kv_local_bytes']} B of its own; copied {merged[3]['kv_kept_copied']} "
          f"and {g['kv_local_copied_bytes']} B; kv_exchanged_bytes {out['kv_exchanged']}")
    _check_kv_exchanged(out, 0)
    MOVED["direct"] = moved / held
    if "restore_then_grow" in MOVED:  # both ran in this session
        ratio = MOVED["direct"] / MOVED["restore_then_grow"]
        print(f"moved per byte of the joining group's KV: direct {MOVED['direct']:.3f}, "
              f"restore then grow {MOVED['restore_then_grow']:.3f} (ratio {ratio:.3f})")
        assert MOVED["direct"] <= 1.0 < MOVED["restore_then_grow"], MOVED
