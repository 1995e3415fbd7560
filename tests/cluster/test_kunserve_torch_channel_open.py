"""A member that dies between its `GroupGo` and opening the group's channel (own two instance
processes; `SHUNTER_TEST_FAULT=channel-open@1`: instance 1 SIGKILLs itself as it starts to
open the channel). The head, opening the channel, learns at once that the member's process is
gone (gpu/data_plane.py `Watch`: its connection to the member reads end-of-stream) and gives
the group up, instead of waiting `channel_open_s` (10 s) for it: it has dropped nothing, the two
requests the member handed over are recomputed at the head, the front door gets the error.
Every request ends with transformers' tokens and the head serves a new one alone.

Planted bug checked by hand: a watch that never finds a member gone (`Watch.lost` always
empty) makes the formation last the whole `channel_open_s`, failing the time bound.
"""

from __future__ import annotations

import random

import anyio
import pytest

import shunter
from shunter.cluster.cluster import Cluster
from tests.cluster.test_kunserve_torch_cluster import _prompt
from tests.cluster.test_kunserve_torch_faults import (  # noqa: F401 (fixtures)
    SOLO_BLOCKS,
    Running,
    _one_event_loop,
    _record_exports,
    by_hand_config,
    fifo_config,
    kunserve_config,
)
from tests.reference import assert_matches, greedy_reference

GIVEN_UP_S = 5.0
"""The formation, from `form` to its error, must end well within `channel_open_s` (10 s);
measured 0.07 s here (load 3.8)."""


def start_doomed(launcher, config, monkeypatch) -> list:
    """Instance 0, and instance 1 which kills itself as it opens a group's channel."""
    from gpu.data_plane import FAULT_ENV

    first = launcher.start_process(0, config)
    monkeypatch.setenv(FAULT_ENV, "channel-open@1")  # read by the spawned process
    second = launcher.start_process(1, config)
    monkeypatch.delenv(FAULT_ENV)
    return [first, second]


@pytest.fixture
def doomed_instances(by_hand_config, monkeypatch):  # noqa: F811
    from shunter.cluster.launch import LocalLauncher

    launcher = LocalLauncher("asyncio")
    try:
        yield start_doomed(launcher, by_hand_config, monkeypatch)
    finally:
        launcher.shutdown(timeout_s=0)


@pytest.mark.anyio
async def test_a_member_dead_before_it_opens_the_channel_is_given_up_at_once(
        anyio_backend, by_hand_config, doomed_instances, kunserve_model):  # noqa: F811
    _one_event_loop(anyio_backend)
    took = await given_up(by_hand_config, doomed_instances, kunserve_model)
    print(f"\nthe group was given up {took:.2f} s after `form` began")


async def given_up(by_hand_config, doomed_instances, kunserve_model) -> float:  # noqa: F811
    """The member dies as it opens the channel; checks the outcome; returns how long `form`
    took to give the group up."""
    from engine.cluster.drop_plan import GroupPlan
    from shunter.cluster.remote_groups import GroupCommandError

    rng = random.Random(15)
    prompts = [_prompt(rng, 6) for _ in range(4)]
    async with Cluster.start(by_hand_config, attach=doomed_instances,
                             monitor_interval_s=0.02) as cluster:
        groups, run = cluster.groups, Running(cluster, prompts)
        moved = _record_exports(groups)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                await run.start(tg)
                began = anyio.current_time()
                with pytest.raises(GroupCommandError, match=r"not formed .*instance 1 was lost "
                                   r"while the group \(0, 1\)'s channel was being opened.*"
                                   r"its process is gone.*the 2 requests handed over are "
                                   r"recomputed at instance 0"):
                    await groups.form(GroupPlan(group_id=9, members=(0, 1),
                                                layers=(range(2), range(2, 4))))
                took = anyio.current_time() - began
                await run.go_past(moved)
            alone = _prompt(rng, 7)
            after = await cluster.complete(alone, shunter.SamplingParams(max_tokens=10,
                                                                         temperature=0))
            head = (await cluster.wait_idle()).snapshots[0].scheduler
            dead = cluster.instances[1].alive
    assert took < GIVEN_UP_S, took
    assert not dead and not cluster.groups.groups
    assert head.total_blocks == SOLO_BLOCKS and not head.live_requests, head
    assert len(moved) == 2, moved
    run.check(kunserve_model)
    assert_matches(after.token_ids, greedy_reference(kunserve_model, alone, 10), "after")
    return took
