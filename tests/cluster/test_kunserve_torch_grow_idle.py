"""A running KunServe group left idle longer than the data plane's timeout stays a group
(shunter/cluster/group_keepalive.py): its members wait for their next step in one receive that
gloo ends after the plane's timeout, so the head sends an empty step when none went for a
quarter of it. Two instance processes whose data plane has a 5 s timeout (60 s by default),
grouped by hand while two requests stream; once they ended the group idles 11 s, then serves a
new request through the pipeline and restores. Without the keepalive the member left at 5 s
(`head lost: ... Timed out waiting 5000ms for recv operation`) and this test fails.
"""

from __future__ import annotations

import random

import anyio
import pytest

import shunter
from engine.cluster.drop_plan import GroupPlan
from engine.cluster.plan import stage_layers
from shunter.cluster.cluster import Cluster
from tests.cluster.test_kunserve_torch_grow import LAYERS, SOLO_BLOCKS, grow_config, grow_model
from tests.reference import assert_matches, greedy_reference

__all__ = ["grow_config", "grow_model"]  # the fixtures, shared with the growth's tests

PLANE_TIMEOUT_S = 5.0
IDLE_S = 11.0


@pytest.mark.anyio
async def test_an_idle_group_outlives_the_data_planes_timeout(anyio_backend, grow_config,
                                                              grow_model, monkeypatch):
    import shunter.cluster.remote_groups as rgmod
    from shunter.cluster.group_wire import JoinDataPlane
    from shunter.cluster.launch import LocalLauncher

    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")

    def join(**kw):
        return JoinDataPlane(**kw, timeout_s=PLANE_TIMEOUT_S)

    monkeypatch.setattr(rgmod, "JoinDataPlane", join)
    launcher = LocalLauncher("asyncio")
    instances = [launcher.start_process(i, grow_config) for i in range(2)]
    rng = random.Random(41)
    prompts = [[rng.randrange(2, 320) for _ in range(6)] for _ in range(3)]
    got: dict[int, list[int]] = {i: [] for i in range(2)}
    try:
        async with Cluster.start(grow_config, attach=instances,
                                 monitor_interval_s=0.02) as cluster:
            groups = cluster.groups

            async def one(i: int, started: anyio.Event) -> None:
                async with cluster.generate(prompts[i], shunter.SamplingParams(
                        max_tokens=24, temperature=0)) as stream:
                    async for chunk in stream:
                        assert chunk.error is None, (i, chunk.error)
                        got[i] += chunk.token_ids
                        if len(got[i]) >= 2:
                            started.set()

            with anyio.fail_after(90):
                async with anyio.create_task_group() as tg:
                    for i in range(2):  # one on each instance
                        started = anyio.Event()
                        tg.start_soon(one, i, started)
                        await started.wait()
                    await groups.form(GroupPlan(group_id=1, members=(0, 1),
                                                layers=stage_layers(LAYERS, 2)))
                await cluster.wait_idle()
                await anyio.sleep(IDLE_S)
                member = (await groups.stats(1))["member"]
                leading = (await groups.stats(0))["head"]["leading"]
                after = await cluster.complete(prompts[2], shunter.SamplingParams(
                    max_tokens=8, temperature=0))
                head = await groups.stats(0)
                assert await groups.restore(0)
                snap = await cluster.wait_idle()
    finally:
        launcher.shutdown(timeout_s=0)
    print(f"\nidle group: member {member}; head pipeline steps {head['head']['pipeline']['steps']}")
    assert member is None and leading, (member, leading)  # still serving the group
    assert head["head"]["leading"] and head["lost"] is None, head
    assert [s.scheduler.total_blocks for s in snap.snapshots] == [SOLO_BLOCKS] * 2
    for i in range(2):
        assert_matches(got[i], greedy_reference(grow_model, prompts[i], 24), f"request {i}")
    assert_matches(after.token_ids, greedy_reference(grow_model, prompts[2], 8), "after")
