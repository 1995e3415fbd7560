"""The allocator actor alone: `RunStep`s pushed into its inbox, the `ExecuteStep` (or, with swaps,
the `SwapOrders`) it sends on, for both device allocators behind the `DeviceBlocks` protocol."""

from __future__ import annotations

import anyio
import attrs
import pytest
import trio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.allocator import Allocator
from engine.memory.block_groups import BlockGroupManager
from engine.memory.block_pool import BlockPool
from engine.memory.device_blocks import DeviceBlocks
from engine.messages import (
    AllocatorMessage,
    BlockUpdate,
    ExecuteStep,
    ExecutorMessage,
    InspectAllocator,
    RequestSetup,
    RunStep,
    SeqWork,
    SwapIn,
    SwapOrders,
    SwapOut,
    SwapPoolMessage,
)
from engine.reply import Reply
from engine.snapshots import AllocatorSnapshot
from shunter import SamplingParams
from tests.actors.inbox import nothing_waiting, receive

pytestmark = pytest.mark.trio

BS = 4


@attrs.define
class Wired:
    pool: DeviceBlocks
    inbox: MemoryObjectSendStream[AllocatorMessage]
    executor: MemoryObjectReceiveStream[ExecutorMessage]
    swap_pool: MemoryObjectReceiveStream[SwapPoolMessage]

    async def execute(self, step: RunStep) -> ExecuteStep:
        await self.inbox.send(step)
        msg = await receive(self.executor)
        assert isinstance(msg, ExecuteStep)
        return msg

    async def inspect(self) -> AllocatorSnapshot:
        reply = Reply[AllocatorSnapshot]()
        await self.inbox.send(InspectAllocator(reply=reply))
        return await reply.wait()


@pytest.fixture(params=["per-block", "groups"])
def pool(request: pytest.FixtureRequest) -> DeviceBlocks:
    return BlockPool(range(64)) if request.param == "per-block" else BlockGroupManager(range(64))


async def _start(nursery: trio.Nursery, pool: DeviceBlocks, *, swap_pool: bool = True) -> Wired:
    inbox_send, inbox = anyio.create_memory_object_stream[AllocatorMessage](4)
    executor, executor_recv = anyio.create_memory_object_stream[ExecutorMessage](4)
    swaps, swaps_recv = anyio.create_memory_object_stream[SwapPoolMessage](4)
    actor = Allocator(pool=pool, inbox=inbox, executor=executor, block_size=BS,
                      swap_pool=swaps if swap_pool else None)
    await nursery.start(actor.run)
    return Wired(pool=pool, inbox=inbox_send, executor=executor_recv, swap_pool=swaps_recv)


def _make_setup(request_id: int, prompt: int = 4, max_tokens: int = 4) -> RequestSetup:
    return RequestSetup(request_id=request_id, prompt_ids=tuple(range(prompt)),
                        sampling=SamplingParams(max_tokens=max_tokens), eos_token_ids=())


def _make_step(step_id: int = 1, **fields: object) -> RunStep:
    defaults: dict[str, object] = dict(release=(), preempt=(), block_targets=(), setups=(),
                                       seqs=())
    defaults.update(fields)
    return RunStep(step_id=step_id, **defaults)  # type: ignore[arg-type]


async def test_block_targets_become_new_blocks_in_the_step(nursery, autojump_clock, pool):
    a = await _start(nursery, pool)
    seqs = (SeqWork(request_id=1, start=0, num_tokens=6, sample=True),)
    first = await a.execute(_make_step(1, setups=(_make_setup(1, prompt=6),), seqs=seqs,
                                       block_targets=((1, 2),)))
    [update] = first.blocks
    assert (first.step_id, first.seqs, first.setups) == (1, seqs, (_make_setup(1, prompt=6),))
    assert (update.request_id, update.reset, len(update.append)) == (1, False, 2)
    again = await a.execute(_make_step(2, block_targets=((1, 2),)))     # a target, not a growth
    assert again.blocks == ()
    grown = await a.execute(_make_step(3, block_targets=((1, 3),)))
    [more] = grown.blocks
    assert len(more.append) == 1 and more.append[0] not in update.append
    snapshot = await a.inspect()
    assert snapshot.tables == {1: [*update.append, *more.append]}
    assert (snapshot.allocated_blocks, snapshot.free_blocks) == (3, 61)


async def test_release_and_recompute_preemption_give_blocks_back(nursery, autojump_clock, pool):
    a = await _start(nursery, pool)
    await a.execute(_make_step(1, setups=(_make_setup(1), _make_setup(2)),
                               block_targets=((1, 2), (2, 3))))
    step = await a.execute(_make_step(2, release=(1,), preempt=(2,)))
    assert step.release == (1,)
    assert step.blocks == (BlockUpdate(request_id=2, reset=True, append=()),)
    assert (await a.inspect()).allocated_blocks == 0


async def test_swaps_go_through_the_swap_pool_outs_first(nursery, autojump_clock, pool):
    a = await _start(nursery, pool)
    first = await a.execute(_make_step(1, setups=(_make_setup(1), _make_setup(2)),
                                       block_targets=((1, 2), (2, 1))))
    held = {u.request_id: u.append for u in first.blocks}
    await a.inbox.send(_make_step(
        2, preempt=(1,), swap_out=(SwapOut(request_id=1, first_block=1, cpu_blocks=(7,)),),
        swap_in=(SwapIn(request_id=3, cpu_blocks=(4, 5), sync=True),),
        block_targets=((3, 3), (2, 1))))
    orders = await receive(a.swap_pool)
    assert isinstance(orders, SwapOrders) and nothing_waiting(a.executor)
    out, in_ = orders.transfers
    assert (out.request_id, out.direction, out.pairs) == (1, "out", ((held[1][1], 7),))
    assert (in_.request_id, in_.direction, in_.sync) == (3, "in", True)
    assert [cpu for _, cpu in in_.pairs] == [4, 5]
    preempted, update = orders.step.blocks          # 2 already holds its one block
    assert preempted == BlockUpdate(request_id=1, reset=True, append=())
    assert (update.request_id, update.reset) == (3, True)  # its swapped-in blocks, one more
    assert update.append[:2] == tuple(dev for dev, _ in in_.pairs) and len(update.append) == 3
    assert (await a.inspect()).tables.keys() == {2, 3}


async def test_swaps_without_a_swap_pool_are_a_bug(autojump_clock, pool):
    with pytest.raises(ExceptionGroup) as failed:
        async with trio.open_nursery() as nursery:
            a = await _start(nursery, pool, swap_pool=False)
            await a.inbox.send(_make_step(1, setups=(_make_setup(1),), block_targets=((1, 1),)))
            await a.inbox.send(_make_step(2, preempt=(1,), swap_out=(
                SwapOut(request_id=1, first_block=0, cpu_blocks=(0,)),)))
            await trio.sleep_forever()
    assert failed.group_contains(
        RuntimeError, match="^a step asked for swaps but the engine has no swap pool$")


async def test_new_requests_tell_block_groups_how_large_to_reserve(nursery, autojump_clock):
    a = await _start(nursery, BlockGroupManager(range(64)))
    step = await a.execute(_make_step(1, setups=(_make_setup(1, prompt=4, max_tokens=12),
                                                 _make_setup(2)),
                                      block_targets=((1, 1), (2, 1))))
    # 1 expects 16 tokens (4 blocks): 2's group starts right after that reservation
    assert [u.append for u in step.blocks] == [(0,), (4,)]


async def test_a_swapped_in_request_keeps_its_group_size_hint(nursery, autojump_clock):
    """Issue 13, defect 1: after a preemption a request still grows inside groups sized from
    its expected length, not one block at a time from wherever a hole is (FastSwitch §3.1)."""
    pool = BlockGroupManager(range(1000), expected_group=60)
    a = await _start(nursery, pool)
    setups = tuple(_make_setup(r, prompt=BS * 70, max_tokens=BS * 30) for r in (1, 2))
    await a.execute(_make_step(1, setups=setups, block_targets=((1, 70), (2, 70))))
    await a.inbox.send(_make_step(2, preempt=(1, 2), swap_out=tuple(
        SwapOut(request_id=r, first_block=0, cpu_blocks=tuple(range(r * 100, r * 100 + 70)))
        for r in (1, 2))))
    await receive(a.swap_pool)
    await a.inbox.send(_make_step(3, swap_in=tuple(
        SwapIn(request_id=r, cpu_blocks=tuple(range(r * 100, r * 100 + 70)), sync=True)
        for r in (1, 2)), block_targets=((1, 70), (2, 70))))
    await receive(a.swap_pool)
    for n, target in enumerate(range(71, 101)):       # both grow a block an iteration
        await a.execute(_make_step(4 + n, block_targets=((1, target), (2, target))))
    # each holds 100 blocks, the size its first group was sized for: one run each
    assert [len(pool.runs(r)) for r in (1, 2)] == [1, 1]
