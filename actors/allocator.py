"""The allocator actor: owns the device block pool and every request's block table.

It turns the scheduler's plan (how many blocks each request must hold) into block ids and passes
the step on to the executor with only the table changes, so one iteration is one message here.
"""

from __future__ import annotations

from typing import assert_never

import anyio
import attrs
import structlog

from engine.memory.block_pool import BlockPool
from engine.messages import AllocatorMessage, BlockUpdate, ExecuteStep, InspectAllocator, RunStep

log = structlog.get_logger().bind(actor="allocator")


@attrs.frozen(kw_only=True)
class AllocatorSnapshot:
    free_blocks: int
    allocated_blocks: int
    total_blocks: int
    tables: dict[int, list[int]]


class Allocator:
    name = "allocator"

    def __init__(self, *, pool: BlockPool, inbox: anyio.abc.ObjectReceiveStream,
                 executor: anyio.abc.ObjectSendStream) -> None:
        self._pool = pool
        self._inbox = inbox
        self._executor = executor

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for msg in self._inbox:
            await self._handle(msg)

    async def _handle(self, msg: AllocatorMessage) -> None:
        match msg:
            case RunStep():
                await self._executor.send(self.apply(msg))
            case InspectAllocator(reply=reply):
                pool = self._pool
                reply.send(AllocatorSnapshot(
                    free_blocks=pool.num_free, allocated_blocks=pool.num_allocated,
                    total_blocks=pool.num_total, tables=pool.owners()))
            case _:
                assert_never(msg)

    def apply(self, plan: RunStep) -> ExecuteStep:
        """Free first, then grow, so blocks released by this plan can serve it."""
        pool = self._pool
        for rid in plan.release:
            pool.free(rid)
        updates: dict[int, BlockUpdate] = {}
        for rid in plan.preempt:
            pool.free(rid)
            updates[rid] = BlockUpdate(request_id=rid, reset=True, append=())
        for rid, target in plan.grow:
            have = len(pool.table(rid))
            if target > have:
                new = tuple(pool.allocate(rid, target - have))
                reset = rid in updates and updates[rid].reset
                updates[rid] = BlockUpdate(request_id=rid, reset=reset, append=new)
        return ExecuteStep(step_id=plan.step_id, release=plan.release, setups=plan.setups,
                           blocks=tuple(updates.values()), seqs=plan.seqs)
