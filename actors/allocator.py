"""The allocator actor: owns the device block pool and every request's block table.

It turns the scheduler's plan (how many blocks each request must hold, which requests swap out
or in) into block ids and passes the step on with only the table changes, so one iteration is
one message here. Steps with swaps go through the swap pool, which dispatches the copies before
the executor sees the step.

Two allocators, chosen by the swap granularity of the policy the engine starts with, both
behind one protocol (`engine.memory.device_blocks.DeviceBlocks`):
- `per-block` (vLLM): a free stack of single blocks (`BlockPool`);
- `groups` (FastSwitch §3.1): block groups (`BlockGroupManager`), so a request's KV is a few
  contiguous runs and a swap of it is a few copies.
"""

from __future__ import annotations

from typing import assert_never

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.memory.block_pool import BlockPool
from engine.memory.device_blocks import DeviceBlocks
from engine.messages import (
    AllocatorMessage,
    BlockUpdate,
    ExecuteStep,
    ExecutorMessage,
    InspectAllocator,
    RunStep,
    SwapOrders,
    SwapPoolMessage,
    SwapTransfer,
)
from engine.snapshots import AllocatorSnapshot

log = structlog.get_logger(actor="allocator")


class Allocator:
    name = "allocator"

    def __init__(self, *, pool: DeviceBlocks, inbox: MemoryObjectReceiveStream[AllocatorMessage],
                 executor: MemoryObjectSendStream[ExecutorMessage], block_size: int = 16,
                 swap_pool: MemoryObjectSendStream[SwapPoolMessage] | None = None) -> None:
        self._pool = pool
        self._block_size = block_size
        self._inbox = inbox
        self._executor = executor
        self._swap_pool = swap_pool
        self._expected: dict[int, int] = {}
        """Each live request's expected size in blocks (prompt + max_tokens), told to the pool
        again whenever the request starts over with no blocks (after a preemption): block groups
        size its next group from it (FastSwitch §3.1), where a lost hint left a request past the
        default 60 blocks growing one block at a time."""

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for msg in self._inbox:
            await self._handle(msg)

    async def _handle(self, msg: AllocatorMessage) -> None:
        match msg:
            case RunStep():
                step, transfers = self.apply(msg)
                if transfers:
                    if self._swap_pool is None:
                        raise RuntimeError("a step asked for swaps but the engine has no swap pool")
                    await self._swap_pool.send(SwapOrders(
                        transfers=transfers, granularity=msg.granularity, step=step))
                else:
                    await self._executor.send(step)
            case InspectAllocator(reply=reply):
                pool = self._pool
                reply.send(AllocatorSnapshot(
                    free_blocks=pool.num_total - pool.num_allocated,
                    allocated_blocks=pool.num_allocated, total_blocks=pool.num_total,
                    tables=pool.owners(), cached_blocks=getattr(pool, "num_cached", 0)))
            case _:
                assert_never(msg)

    def apply(self, plan: RunStep) -> tuple[ExecuteStep, tuple[SwapTransfer, ...]]:
        """Swap-outs read the tables first; then free; then swap-ins and growth take blocks,
        so blocks released by this plan can serve it (the swap pool and the executor wait
        for the copies still reading them)."""
        if plan.bidirectional is not None:  # BROS §5: the scheduler's table placed every slot
            return (ExecuteStep(step_id=plan.step_id, release=plan.release, setups=plan.setups,
                                blocks=plan.bidirectional.blocks, seqs=plan.seqs),
                    plan.bidirectional.transfers)
        pool = self._pool
        for s in plan.setups:  # block groups size new requests' first groups to fit them
            tokens = len(s.prompt_ids) + s.sampling.max_tokens
            self._expected[s.request_id] = -(-tokens // self._block_size)
        prefix = plan.prefix
        if prefix is not None and not isinstance(pool, BlockPool):
            # the policy checker refuses prefix_cache with block groups (policy_lang/check.py)
            raise RuntimeError("prefix caching needs the per-block allocator")
        for rid, index, key in prefix.publish if prefix else ():
            pool.publish(rid, index, key)
        transfers = self._swap_outs(plan)
        for rid in plan.release:
            pool.free(rid)
            self._expected.pop(rid, None)
        updates: dict[int, BlockUpdate] = {}
        moves = self._resize(plan.pool_blocks, updates) if plan.pool_blocks is not None else ()
        for rid in plan.preempt:
            pool.free(rid)
            updates[rid] = BlockUpdate(request_id=rid, reset=True, append=())
        for key in prefix.evict if prefix else ():
            pool.evict(key)
        for rid, keys in prefix.attach if prefix else ():
            updates[rid] = BlockUpdate(request_id=rid, reset=True,
                                       append=tuple(pool.attach(rid, keys)))
        for i in plan.swap_in:
            if pool.table(i.request_id):
                raise RuntimeError(f"request {i.request_id} is swapped in but still holds blocks")
            self._renew_hint(i.request_id)
            got = pool.allocate(i.request_id, len(i.cpu_blocks))
            transfers.append(SwapTransfer(request_id=i.request_id, direction="in",
                                          pairs=tuple(zip(got, i.cpu_blocks)), sync=i.sync))
            updates[i.request_id] = BlockUpdate(request_id=i.request_id, reset=True,
                                                append=tuple(got))
        for rid, target in plan.block_targets:
            have = len(pool.table(rid))
            if target > have:
                if not have:
                    self._renew_hint(rid)
                new = tuple(pool.allocate(rid, target - have))
                old = updates.get(rid)
                if old is None:
                    updates[rid] = BlockUpdate(request_id=rid, reset=False, append=new)
                else:
                    updates[rid] = BlockUpdate(request_id=rid, reset=old.reset,
                                               append=old.append + new)
        step = ExecuteStep(step_id=plan.step_id, release=plan.release, setups=plan.setups,
                           blocks=tuple(updates.values()), seqs=plan.seqs,
                           pool_blocks=plan.pool_blocks, moves=tuple(moves), group=plan.group)
        return step, tuple(transfers)

    def _resize(self, blocks: int, updates: dict[int, BlockUpdate]) -> list[tuple[int, int]]:
        """KunServe: the pool grows by the blocks freed weights became, or shrinks back; tables
        whose blocks moved are sent whole to the executor."""
        resize = getattr(self._pool, "resize", None)
        if resize is None:
            raise RuntimeError("KunServe's pool resizing needs the per-block allocator")
        moves = resize(blocks)
        for rid in {rid for rid, t in self._pool.owners().items() for b in t
                    if b in {d for _, d in moves}}:
            updates[rid] = BlockUpdate(request_id=rid, reset=True,
                                       append=tuple(self._pool.table(rid)))
        return moves

    def _renew_hint(self, request_id: int) -> None:
        """A request starting with no blocks (new, or back after a preemption) tells the pool
        its expected size again; freeing its blocks made the pool forget it."""
        blocks = self._expected.get(request_id)
        if blocks is not None:
            self._pool.expect(request_id, blocks)

    def _swap_outs(self, plan: RunStep) -> list[SwapTransfer]:
        """The device -> host copies of the plan, read off the tables before anything is freed."""
        transfers = []
        for o in plan.swap_out:
            table = self._pool.table(o.request_id)
            blocks = table[o.first_block:o.first_block + len(o.cpu_blocks)]
            if len(blocks) != len(o.cpu_blocks):
                raise RuntimeError(f"request {o.request_id}: swap-out of blocks "
                                   f"{o.first_block}..{o.first_block + len(o.cpu_blocks)} but it "
                                   f"holds {len(table)}")
            if blocks:
                transfers.append(SwapTransfer(request_id=o.request_id, direction="out",
                                              pairs=tuple(zip(blocks, o.cpu_blocks))))
        return transfers
