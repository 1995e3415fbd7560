"""KunServe's queued-request moves (§4.1: queued requests go where the memory is) do not wait
for a step boundary (engine/cluster/adoption.py `queue_only`): a move that waited for one at
both ends held the coordinator's monitor up 0.4-1.24 s at a time in the azure-conv burst, so
when the next drop came depended on step phases. A regroup that does wait (a group forming)
still applies before a move sent after it. Virtual time throughout."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import trio
import trio.testing

import shunter
from engine.cluster.drop_plan import GroupPlan
from engine.config import EngineConfig
from engine.messages import Regroup
from engine.reply import Reply
from policies import policy_path
from shunter.cluster.cluster import Cluster
from shunter.cluster.groups import SimGroups
from shunter.engine import Engine


def _virtual(fn, *args):
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


async def _ask(engine, make):
    reply = Reply()
    await engine._scheduler_send.send(make(reply))
    return await reply.wait()


async def _mid_step(engine, tg) -> None:
    """One long prefill running (a step in flight) and five requests queued behind it."""
    for i in range(6):
        tg.start_soon(engine.complete, [5 + i] * 2000, shunter.SamplingParams(
            max_tokens=50, ignore_eos=True))
        await anyio.lowlevel.checkpoint()
    while True:
        s = (await engine.inspect()).scheduler
        if s.running == 1 and s.waiting == 5:
            return
        await anyio.sleep(0.001)


async def _move_mid_step():
    # one sequence at a time: a 2,000-token prompt's prefill steps are in flight
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=400, max_num_seqs=1,
                          max_batched_tokens=2048)
    async with Engine.start(config) as engine, anyio.create_task_group() as tg:
        await _mid_step(engine, tg)
        t0 = anyio.current_time()
        out = await _ask(engine, lambda r: Regroup(export_queued=True, reply=r))
        took = anyio.current_time() - t0
        running = (await engine.inspect()).scheduler.running
        tg.cancel_scope.cancel()
    return took, len(out), running


def test_a_queued_move_does_not_wait_for_the_step_in_flight():
    took, moved, running = _virtual(_move_mid_step)
    assert moved == 5 and running == 1
    assert took == 0.0  # at a step boundary it waited for the prefill (about 0.1 s here)


async def _form_then_move():
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=400, max_num_seqs=1,
                          max_batched_tokens=2048)
    async with Engine.start(config) as engine, anyio.create_task_group() as tg:
        await _mid_step(engine, tg)
        solo = GroupPlan(group_id=-1, members=(0,), layers=(range(32),))
        join, move = Reply(), Reply()  # a member joining a group, then a move, in that order
        await engine._scheduler_send.send(Regroup(export=True, group=solo, reply=join))
        await engine._scheduler_send.send(Regroup(export_queued=True, reply=move))
        got = {"join": len(await join.wait()), "move": len(await move.wait())}
        tg.cancel_scope.cancel()
    return got


def test_a_move_sent_after_a_group_change_waits_for_it():
    # the join hands over all six (five of them queued); the move, applied after it, finds
    # none. Applied at once it would take the five queued to another head while the join
    # waited for the step
    assert _virtual(_form_then_move) == {"join": 6, "move": 0}


async def _moves_in_a_cluster(policy):
    # three instances of 300 blocks; (0, 1) grouped by hand; the drop condition never holds,
    # so every monitor round moves instance 2's overflow to the head
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300, policy=policy,
                          max_batched_tokens=1024)
    async with Cluster.start(config, instances=3, kind="inprocess") as cluster:
        pair = GroupPlan(group_id=0, members=(0, 1), layers=(range(16), range(16, 32)))
        await cluster.groups._form(pair)
        ends = []

        async def one(i: int) -> None:
            done = await cluster.complete([3 + i % 40] * 1500, shunter.SamplingParams(
                max_tokens=100, ignore_eos=True))
            ends.append((done.finish_reason, len(done.token_ids)))

        with anyio.fail_after(300):
            async with anyio.create_task_group() as tg:
                for i in range(40):
                    tg.start_soon(one, i)
                    await anyio.sleep(0.01)
            snap = await cluster.wait_idle()
    return ends, snap


def test_moves_in_a_cluster_take_no_monitor_time_and_every_request_ends(monkeypatch, tmp_path):
    policy = tmp_path / "never_drops.policy"
    policy.write_text(f'policy never_drops extends "{policy_path("kunserve_drop")}" {{\n'
                      "  overload drop when head_tokens > 1000000000 tokens for 2 iterations\n}\n")
    moves: list[tuple[float, int]] = []
    move = SimGroups._move

    async def timed(self, src, head, *, queued_only):
        t0 = anyio.current_time()
        out = await move(self, src, head, queued_only=queued_only)
        moves.append((anyio.current_time() - t0, len(out)))
        return out

    monkeypatch.setattr(SimGroups, "_move", timed)
    ends, snap = _virtual(_moves_in_a_cluster, policy)
    assert sorted(set(ends)) == [("length", 100)] and len(ends) == 40
    assert all(s.allocator.allocated_blocks == 0 for s in snap.snapshots)
    assert sum(n for _, n in moves) > 0
    assert max(t for t, _ in moves) == 0.0  # waiting for steps at both ends: 0.1-0.3 s each
