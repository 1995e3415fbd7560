"""A KunServe group of torch instance processes restores while its requests stream
(shunter/cluster/instance_restore.py, gpu/restore_prefetch.py): two instances of the tiny
6-layer model (tests/cluster/test_kunserve_torch_grow.py's), two requests streaming on each;
instances 0 and 1 form a group by hand, then the front door restores it (`LeaveGroup`): the
head's pool shrinks back, every member writes its dropped layers back in place while the group
keeps serving, and only the KV moves at the restore's step. Every request goes on streaming and
its tokens equal transformers'.

A member lost while the prefetch runs (`SHUNTER_TEST_FAULT=restore-prefetch@1`: instance 1
SIGKILLs itself as the prefetch reaches it): the head serves alone from its host copy and
recomputes every request (they all stream from it: the member handed its own over when the
group formed), which still give transformers' tokens; nothing is left held.

A policy with `memory { restore_prefetch off; restore_from host }`: the same restore happens
at one step (nothing before it), the weights from each member's host copy, and the tokens still
equal transformers'.
"""

from __future__ import annotations

import random

import anyio
import attrs
import pytest

from engine.cluster.drop_plan import GroupPlan
from engine.cluster.plan import stage_layers
from shunter.cluster.cluster import Cluster
from tests.cluster.test_kunserve_torch_grow import LAYERS, SOLO_BLOCKS, grow_config, grow_model
from tests.cluster.test_kunserve_torch_grow_faults import Streams, _references
from tests.reference import Reference, assert_matches

__all__ = ["grow_config", "grow_model"]  # the fixtures


async def _restore_while_streaming(grow_config, monkeypatch, fault: str | None) -> dict:
    from shunter.cluster.launch import LocalLauncher

    if fault is not None:
        monkeypatch.setenv("SHUNTER_TEST_FAULT", fault)  # the processes inherit it
    launcher = LocalLauncher("asyncio")
    instances = [launcher.start_process(i, grow_config) for i in range(2)]
    if fault is not None:
        monkeypatch.delenv("SHUNTER_TEST_FAULT")
    rng = random.Random(31)
    prompts = [[rng.randrange(2, 320) for _ in range(6)] for _ in range(4)]
    out: dict = {"prompts": prompts}
    try:
        async with Cluster.start(grow_config, attach=instances,
                                 monitor_interval_s=0.02) as cluster:
            groups, run = cluster.groups, Streams(cluster, prompts)
            with anyio.fail_after(150):
                async with anyio.create_task_group() as tg:
                    await run.start(tg)
                    await groups.form(GroupPlan(group_id=1, members=(0, 1),
                                                layers=stage_layers(LAYERS, 2)))
                    await run.past(run.marks())
                    assert [len(i._live) for i in cluster.instances] == [4, 0]
                    out["restored"] = await groups.restore(0)
                    out["marks"] = run.marks()
                    await run.past(out["marks"])
                    run.cancel()
                with anyio.fail_after(30):  # a lost member's group: the monitor's next round
                    while groups.groups:
                        await anyio.sleep(0.01)
                out["report"] = groups.report(0.0)
                out["head"] = (await groups.stats(0))["head"]
                out["lost"] = (await groups.stats(0))["lost"]
                out["snap"] = await cluster.wait_idle()
                out["live"] = [sorted(i._live) for i in cluster.instances]
                out["groups"] = dict(groups.groups)
    finally:
        launcher.shutdown(timeout_s=0)
    out["got"] = run.got
    return out


def _check(out, model, alive) -> None:
    assert not out["groups"] and out["live"] == [[], []], (out["groups"], out["live"])
    for k in alive:
        s = out["snap"].snapshots[k].scheduler
        assert s.total_blocks == SOLO_BLOCKS and s.free_blocks == SOLO_BLOCKS, (k, s)
    refs = _references(model, out["prompts"], max(len(g) for g in out["got"].values()))
    for i, got in out["got"].items():
        assert len(got) >= out["marks"][i] + 3, (i, out["marks"][i], got)
        assert_matches(got, Reference(tokens=refs[i].tokens[:len(got)],
                                      top2=refs[i].top2[:len(got)]), f"request {i}")


@pytest.mark.anyio
async def test_a_group_restores_while_its_requests_stream(anyio_backend, grow_config,
                                                         grow_model, monkeypatch):
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    out = await _restore_while_streaming(grow_config, monkeypatch, None)
    assert out["restored"]
    (event,) = [e for e in out["report"]["events"] if e["event"] == "restore"]
    restore = out["head"]["restore"]
    print(f"\nrestore while streaming: {event}; head {restore}")
    assert event["prefetched"] and not event["restored_at_once"], event
    assert restore["prefetched"] and restore["weight_bytes_at"] == 0, restore
    assert restore["weight_bytes_before"] > 0 and restore["kv_bytes_before"] > 0, restore
    assert restore["source"] == "peer", restore
    _check(out, grow_model, alive=(0, 1))


@pytest.mark.anyio
async def test_a_policy_without_the_prefetch_restores_at_one_step(anyio_backend, grow_config,
                                                                 grow_model, monkeypatch,
                                                                 tmp_path):
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    policy = tmp_path / "kunserve_at_step.policy"
    policy.write_text(f'policy kunserve_at_step extends "{grow_config.policy}" {{\n'
                      f'  memory {{ restore_prefetch off; restore_from host }}\n}}\n')
    out = await _restore_while_streaming(attrs.evolve(grow_config, policy=policy), monkeypatch,
                                         None)
    assert out["restored"]
    (event,) = [e for e in out["report"]["events"] if e["event"] == "restore"]
    restore = out["head"]["restore"]
    print(f"\nrestore at one step: {event}; head {restore}")
    assert not event["prefetched"] and not event["restored_at_once"], event
    assert not restore["prefetched"] and restore["source"] == "host", restore
    assert restore["weight_bytes_at"] > 0 and restore["kv_bytes_before"] == 0, restore
    assert restore["kv_bytes_at"] > 0, restore
    _check(out, grow_model, alive=(0, 1))


@pytest.mark.anyio
async def test_a_member_lost_while_the_restore_is_prefetched(anyio_backend, grow_config,
                                                            grow_model, monkeypatch):
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    out = await _restore_while_streaming(grow_config, monkeypatch, "restore-prefetch@1")
    print(f"\nmember lost while prefetching: {out['report']}; head lost {out['lost']}")
    assert not out["restored"], "the restore of a group that lost a member succeeded"
    assert "member instance 1 was lost" in out["lost"], out["lost"]
    events = [e["event"] for e in out["report"]["events"]]
    assert events == ["group", "lost"], out["report"]["events"]
    _check(out, grow_model, alive=(0,))
