"""The swap pool actor: dispatches an iteration's KV copies and reports finished swap-ins
(FastSwitch §3.2, Algorithm 1).

It receives one `SwapOrders` per iteration that swaps, hands every transfer to the swapper
(worker threads and a copy stream on the torch backend, a modelled copy engine in the simulator),
which returns at once, and forwards the step to the executor with the tickets of its synchronous
swap-ins. Asynchronous swap-ins run on while the following steps compute; the pool polls the
swapper while any is pending and tells the scheduler which finished (`SwapDone`), so the
scheduler can return them to the running batch at the start of its next iteration. The pool
alone reads the swapper's traffic counters: it hands them out on `TakeSwapCounters`, and their
totals since the start on `InspectSwapPool`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol, assert_never

import anyio
import attrs
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.iteration_log import SwapCounters
from engine.messages import (
    ExecutorMessage,
    SchedulerMessage,
    SwapDirection,
    InspectSwapPool,
    SwapDone,
    SwapOrders,
    SwapPoolMessage,
    TakeSwapCounters,
)
from engine.policy import SwapGranularity

log = structlog.get_logger(actor="swap_pool")


class Swapper(Protocol):
    """The copier the pool drives: `gpu.swap.TorchSwapper`, or the simulator's `SimSwapper`."""

    def submit(self, ticket_id: int, direction: SwapDirection,
               pairs: Sequence[tuple[int, int]], granularity: SwapGranularity) -> None: ...

    def poll(self) -> list[int]:
        """Tickets finished since the last poll, failed ones included."""

    def take_failures(self) -> dict[int, str]:
        """Tickets whose copies failed since the last call, with the error."""

    def next_poll_s(self) -> float | None:
        """Seconds until polling again is worthwhile; None when nothing is pending."""

    def counters(self) -> SwapCounters:
        """Traffic since the swapper was made."""

    def close(self) -> None:
        """Stop the copy workers (the Engine calls it once the actors have stopped)."""


@attrs.define(slots=True)
class _Pending:
    request_id: int
    blocks: int
    submitted: float
    report: bool
    """An asynchronous swap-in the scheduler waits to hear about."""


class SwapPool:
    name = "swap_pool"

    def __init__(self, *, swapper: Swapper, inbox: MemoryObjectReceiveStream[SwapPoolMessage],
                 executor: MemoryObjectSendStream[ExecutorMessage],
                 scheduler: MemoryObjectSendStream[SchedulerMessage]) -> None:
        self.swapper = swapper
        self._inbox = inbox
        self._executor = executor
        self._scheduler = scheduler
        self._tickets = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._counted = SwapCounters()
        """The swapper's counters at the last `TakeSwapCounters`."""

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            wait = self.swapper.next_poll_s()
            msg = None
            if wait is None:
                msg = await self._inbox.receive()
            else:
                with anyio.move_on_after(wait):
                    msg = await self._inbox.receive()
            if msg is not None:
                await self._handle(msg)
            await self._report()

    async def _handle(self, msg: SwapPoolMessage) -> None:
        match msg:
            case SwapOrders():
                await self._dispatch(msg)
            case TakeSwapCounters(reply=reply):
                now = self.swapper.counters()
                reply.send(now.minus(self._counted))
                self._counted = now
            case InspectSwapPool(reply=reply):
                reply.send(self.swapper.counters())
            case _:
                assert_never(msg)

    async def _dispatch(self, msg: SwapOrders) -> None:
        now = anyio.current_time()
        sync: list[int] = []
        for t in msg.transfers:  # swap-outs first (see SwapOrders.transfers)
            ticket = next(self._tickets)
            self.swapper.submit(ticket, t.direction, t.pairs, msg.granularity)
            self._pending[ticket] = _Pending(
                request_id=t.request_id, blocks=len(t.pairs), submitted=now,
                report=t.direction == "in" and not t.sync)
            if t.sync:  # a swap-in, or a slot copy the step needs (BROS's checkpoints)
                sync.append(ticket)
        await self._executor.send(attrs.evolve(msg.step, wait_tickets=tuple(sync)))

    async def _report(self) -> None:
        done = self.swapper.poll()
        if not done:
            return
        failures = self.swapper.take_failures()
        now = anyio.current_time()
        finished = [(tid, p) for tid in done if (p := self._pending.pop(tid, None)) is not None]
        reported = [p for tid, p in finished if p.report and tid not in failures]
        failed = tuple(sorted({p.request_id for tid, p in finished if tid in failures}))
        if failed:
            log.error("swap copies failed", requests=failed, error=next(iter(failures.values())))
        if reported or failed:
            # the makespan of the batch, per block: swap-ins issued together queue behind each
            # other on the copy engine, so summing their latencies would count that queue twice
            blocks = sum(p.blocks for p in reported)
            per_block = (now - min(p.submitted for p in reported)) / blocks if blocks else None
            await self._scheduler.send(SwapDone(
                request_ids=tuple(p.request_id for p in reported), seconds_per_block=per_block,
                failed=failed, error=next(iter(failures.values()), None)))
