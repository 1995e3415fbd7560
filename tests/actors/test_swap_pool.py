"""The swap pool actor alone: orders pushed into its inbox, what it sends the executor and the
scheduler, on a virtual clock (a `FakeSwapper` whose copies each take 10 ms of it)."""

from __future__ import annotations

import anyio
import attrs
import pytest
import trio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.swap_pool import SwapPool
from engine.iteration_log import SwapCounters
from engine.messages import (
    ExecuteStep,
    ExecutorMessage,
    SchedulerMessage,
    SwapDone,
    SwapOrders,
    SwapPoolMessage,
    SwapTransfer,
    TakeSwapCounters,
)
from engine.reply import Reply
from tests.actors.inbox import nothing_waiting, receive
from tests.fakes import FakeSwapper

pytestmark = pytest.mark.trio


@attrs.define
class Wired:
    swapper: FakeSwapper
    inbox: MemoryObjectSendStream[SwapPoolMessage]
    executor: MemoryObjectReceiveStream[ExecutorMessage]
    scheduler: MemoryObjectReceiveStream[SchedulerMessage]


@pytest.fixture
async def pool(nursery: trio.Nursery) -> Wired:
    return await start_pool(nursery, FakeSwapper(copy_s=0.01))


async def start_pool(nursery: trio.Nursery, swapper: FakeSwapper) -> Wired:
    inbox_send, inbox = anyio.create_memory_object_stream[SwapPoolMessage](8)
    executor, executor_recv = anyio.create_memory_object_stream[ExecutorMessage](8)
    scheduler, scheduler_recv = anyio.create_memory_object_stream[SchedulerMessage](8)
    actor = SwapPool(swapper=swapper, inbox=inbox, executor=executor, scheduler=scheduler)
    await nursery.start(actor.run)
    return Wired(swapper=swapper, inbox=inbox_send, executor=executor_recv,
                 scheduler=scheduler_recv)


def make_step(step_id: int = 7) -> ExecuteStep:
    return ExecuteStep(step_id=step_id, release=(), setups=(), blocks=(), seqs=())


def orders(*transfers: SwapTransfer, step_id: int = 7) -> SwapOrders:
    return SwapOrders(transfers=transfers, granularity="groups", step=make_step(step_id))


OUT = SwapTransfer(request_id=1, direction="out", pairs=((4, 0), (5, 1)))
SYNC_IN = SwapTransfer(request_id=2, direction="in", pairs=((6, 2),), sync=True)
ASYNC_IN = SwapTransfer(request_id=3, direction="in", pairs=((8, 3), (9, 4)))



async def test_orders_dispatch_every_copy_and_forward_the_step_with_its_sync_tickets(
        pool, autojump_clock):
    await pool.inbox.send(orders(OUT, SYNC_IN, ASYNC_IN))
    step = await receive(pool.executor)
    assert pool.swapper.submitted == [
        (1, "out", ((4, 0), (5, 1)), "groups"),
        (2, "in", ((6, 2),), "groups"),
        (3, "in", ((8, 3), (9, 4)), "groups"),
    ]
    assert step == attrs.evolve(make_step(), wait_tickets=(2,))


async def test_an_async_swap_in_is_reported_when_it_ends_and_the_others_are_not(
        pool, autojump_clock):
    began = trio.current_time()
    await pool.inbox.send(orders(OUT, SYNC_IN, ASYNC_IN))
    await receive(pool.executor)
    done = await receive(pool.scheduler)
    assert trio.current_time() - began == pytest.approx(0.01)
    assert done.request_ids == (3,) and done.failed == () and done.error is None
    assert done.seconds_per_block == pytest.approx(0.01 / 2)  # 2 blocks in 10 ms
    await trio.sleep(1)
    assert nothing_waiting(pool.scheduler)  # the swap-out and the sync swap-in go unreported


async def test_swap_ins_ending_together_are_reported_in_one_message(pool, autojump_clock):
    other = SwapTransfer(request_id=9, direction="in", pairs=((10, 5),))
    await pool.inbox.send(orders(ASYNC_IN, other))
    await receive(pool.executor)
    done = await receive(pool.scheduler)
    assert done.request_ids == (3, 9)
    # the batch's makespan (first dispatch to the report) over all their blocks: copies
    # issued together queue behind each other, so their latencies are not summed
    assert done.seconds_per_block == pytest.approx(0.01 / 3)


async def test_a_failed_copy_names_the_request_it_moved(nursery, autojump_clock):
    pool = await start_pool(nursery, FakeSwapper(fail={1: "OSError: link down"}))
    await pool.inbox.send(orders(OUT, ASYNC_IN))
    await receive(pool.executor)
    done = await receive(pool.scheduler)
    assert done == SwapDone(request_ids=(3,), seconds_per_block=pytest.approx(0.005),
                            failed=(1,), error="OSError: link down")


async def test_a_failed_async_swap_in_is_reported_failed_not_done(nursery, autojump_clock):
    pool = await start_pool(nursery, FakeSwapper(fail={1: "RuntimeError: bad block"}))
    await pool.inbox.send(orders(ASYNC_IN))
    await receive(pool.executor)
    done = await receive(pool.scheduler)
    assert done == SwapDone(request_ids=(), seconds_per_block=None, failed=(3,),
                            error="RuntimeError: bad block")


async def take(pool: Wired) -> dict[str, float]:
    reply = Reply[SwapCounters]()
    await pool.inbox.send(TakeSwapCounters(reply=reply))
    return attrs.asdict(await reply.wait())


async def test_counters_are_handed_out_since_the_last_take(pool, autojump_clock):
    zero = attrs.asdict(SwapCounters())
    assert await take(pool) == zero
    await pool.inbox.send(orders(OUT, SYNC_IN))
    await receive(pool.executor)
    assert await take(pool) == {**zero, "copy_ops": 2, "blocks_out": 2, "blocks_in": 1}
    assert await take(pool) == zero
    await pool.inbox.send(orders(ASYNC_IN, step_id=8))
    await receive(pool.executor)
    assert await take(pool) == {**zero, "copy_ops": 1, "blocks_in": 2}


async def test_counters_are_answered_while_swaps_are_pending(pool, autojump_clock):
    began = trio.current_time()
    await pool.inbox.send(orders(ASYNC_IN))
    await receive(pool.executor)
    assert (await take(pool))["blocks_in"] == 2
    assert trio.current_time() == began  # no waiting for the copy to end
    assert (await receive(pool.scheduler)).request_ids == (3,)
