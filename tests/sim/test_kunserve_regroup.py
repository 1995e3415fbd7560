"""A group's head that joins a larger group as a member (the planner merging two groups, §4.1)
exports every request and shrinks its pool back to its own in one `Regroup`: the shrink must
not be refused for blocks the exported requests are taking with them (a 4-instance azure-conv
run with LongBench-like lengths failed with "12173 blocks are held, the pool would have 2501")."""

from __future__ import annotations

import anyio
import trio
import trio.testing

import shunter
from engine.cluster.drop_plan import GroupPlan
from engine.config import EngineConfig
from engine.messages import Regroup
from engine.reply import Reply
from shunter.engine import Engine
from sim.group import GroupNetwork
from sim.network import LINKS


async def _head_joins_a_larger_group():
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300)
    async with Engine.start(config) as engine, anyio.create_task_group() as tg:
        runner = engine.backend.runner
        runner.network = GroupNetwork(link=LINKS["a100-internode"], model=runner._model)

        async def ask(make):
            reply = Reply()
            await engine._scheduler_send.send(make(reply))
            return await reply.wait()

        pair = GroupPlan(group_id=0, members=(0, 1), layers=(range(16), range(16, 32)))
        await ask(lambda r: Regroup(pool_blocks=3000, group=pair, reply=r))  # heads a group

        async def one(i: int) -> None:
            await engine.complete([5 + i] * 400, shunter.SamplingParams(max_tokens=300,
                                                                        ignore_eos=True))

        for i in range(20):  # 20 x 25+ blocks: more than its own 300
            tg.start_soon(one, i)
        await anyio.sleep(2.0)
        held = (await engine.inspect()).allocator.allocated_blocks
        solo = GroupPlan(group_id=-1, members=(0,), layers=(range(32),))
        out = await ask(lambda r: Regroup(export=True, pool_blocks=300, group=solo, reply=r))
        await anyio.sleep(0.5)
        after = await engine.inspect()
        tg.cancel_scope.cancel()
    return held, len(out), after


def test_a_head_joining_a_larger_group_exports_everything_and_shrinks():
    held, exported, after = trio.run(_head_joins_a_larger_group,
                                     clock=trio.testing.MockClock(autojump_threshold=0))
    assert held > 300 and exported == 20
    assert after.scheduler.total_blocks == 300 and after.allocator.allocated_blocks == 0
