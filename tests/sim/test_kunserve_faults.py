"""KunServe on simulated instances when an instance is lost while grouped (§4.4, fault
tolerance; shunter/cluster/sim_faults.py), and the coordinator's triggers following a policy
replaced at run time."""

from __future__ import annotations

from pathlib import Path

import anyio
import trio
import trio.testing

import shunter
from engine.config import EngineConfig
from engine.errors import RequestFailedError
from policies import policy_path
from shunter.cluster.cluster import Cluster

PARAMS = shunter.SamplingParams(max_tokens=200, ignore_eos=True)


def _virtual(fn, *args):
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


def _config(policy) -> EngineConfig:
    return EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300, policy=policy)


async def _burst(cluster, ends: list, n: int = 40) -> None:
    async def one(i: int) -> None:
        await anyio.sleep(i * 0.005)
        try:
            done = await cluster.complete(list(range(1, 400)), PARAMS)
        except RequestFailedError as exc:
            ends.append(("error", 0, str(exc)))
            return
        ends.append((done.finish_reason, len(done.token_ids), None))

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)


async def _lose_while_grouped(which: str):
    async with Cluster.start(_config(policy_path("kunserve")), instances=2,
                             kind="inprocess") as cluster:
        ends: list = []
        with anyio.fail_after(300):  # virtual seconds: a request left without an end hangs
            async with anyio.create_task_group() as tg:
                tg.start_soon(_burst, cluster, ends)
                while not cluster.groups.groups:
                    await anyio.sleep(0.05)
                await anyio.sleep(0.5)  # pipelined steps with KV on both members
                (head, g), = cluster.groups.groups.items()
                lost = head if which == "head" else g.members[1]
                doomed = cluster.instances[lost].engine
                await doomed._scheduler_send.send("not a message")  # its engine fails
            while cluster.table.redirect:  # the survivors reload their layers
                await anyio.sleep(0.1)
            snap = await cluster.wait_idle()
            after = await cluster.complete(list(range(1, 9)), shunter.SamplingParams(
                max_tokens=4, ignore_eos=True))
        return ends, snap, after, cluster.groups.counters, head, lost


def test_a_member_lost_while_grouped_leaves_the_head_serving_alone_with_recomputed_requests():
    ends, snap, after, c, head, lost = _virtual(_lose_while_grouped, "member")
    # the KV of the lost member's layers is gone: the head's requests are prefilled again and
    # every one still ends with all its tokens
    assert sorted(set(ends)) == [("length", 200, None)] and len(ends) == 40
    assert c.faults == 1 and c.recomputed_requests > 0
    fault = next(e for e in c.events if e["event"] == "fault")
    # the head's own 16 dropped layers (8 GB) come back from its host copy at 32 GB/s
    assert fault["lost"] == [lost] and 0.2 < fault["reload_s"] < 0.5
    s = snap.snapshots[head]
    assert s.scheduler.total_blocks == 300 and s.allocator.allocated_blocks == 0
    assert snap.snapshots[lost] is None and not snap.views[lost].alive
    assert after.finish_reason == "length"


def test_a_head_lost_while_grouped_fails_its_requests_and_the_member_serves_alone():
    ends, snap, after, c, head, lost = _virtual(_lose_while_grouped, "head")
    assert lost == head and len(ends) == 40
    # the head held every request of the group: those it had not finished end with its error
    failed = [e for e in ends if e[0] == "error"]
    assert failed and all("scheduler actor failed" in e[2] for e in failed)
    assert all(e == ("length", 200, None) for e in ends if e[0] != "error")
    member = 1 - head
    assert c.faults == 1 and c.recomputed_requests == 0
    s = snap.snapshots[member]
    assert s.scheduler.total_blocks == 300 and s.allocator.allocated_blocks == 0
    assert after.finish_reason == "length"  # served by the member, alone again


async def _replaced(tmp_path: Path):
    calm = tmp_path / "calm.policy"  # KunServe whose drop never fires
    calm.write_text(f'policy calm extends "{policy_path("kunserve")}" {{\n'
                    f'  overload drop when waiting > 100000\n}}\n')
    async with Cluster.start(_config(calm), instances=2, kind="inprocess") as cluster:
        first: list = []
        with anyio.fail_after(300):
            await _burst(cluster, first, n=30)
            await cluster.wait_idle()
            drops_before = cluster.groups.counters.drops
            await cluster.replace_policy(  # KunServe itself (`dispatch` as it already says)
                f'policy k extends "{policy_path("kunserve")}" {{\n  dispatch least_load\n}}\n')
            second: list = []
            await _burst(cluster, second, n=30)
            await cluster.wait_idle()
        return drops_before, cluster.groups.counters.drops, first + second


def test_a_policy_replaced_at_run_time_gives_the_monitor_its_triggers(tmp_path):
    before, after, ends = _virtual(_replaced, tmp_path)
    assert before == 0  # the running policy's drop never fires
    assert after >= 1  # the replacement's does, on the same burst
    assert sorted(set(ends)) == [("length", 200, None)]
