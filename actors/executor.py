"""The executor actor: runs one step at a time on its backend and reports to the scheduler.

The backend (`gpu.runner.TorchRunner`, or the simulator's runner) does the work; a step that
raises fails only the requests in it, and the engine goes on.
"""

from __future__ import annotations

from typing import Protocol

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.messages import (
    ExecuteStep,
    ExecutorMessage,
    SchedulerMessage,
    StepFailed,
    StepFinished,
)

log = structlog.get_logger(actor="executor")


class StepRunner(Protocol):
    async def start(self) -> range:
        """Prepare the device (load weights); returns the KV block ids the allocator may use."""

    async def step(self, step: ExecuteStep) -> StepFinished: ...


class Executor:
    name = "executor"

    def __init__(self, *, runner: StepRunner, inbox: MemoryObjectReceiveStream[ExecutorMessage],
                 scheduler: MemoryObjectSendStream[SchedulerMessage]) -> None:
        self._runner = runner
        self._inbox = inbox
        self._scheduler = scheduler

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """The runner was started (weights loaded) by `Engine.start` before the actors."""
        task_status.started()
        async for msg in self._inbox:
            await self._scheduler.send(await self._run_step(msg))

    async def _run_step(self, msg: ExecuteStep) -> StepFinished | StepFailed:
        try:
            return await self._runner.step(msg)
        except Exception as exc:  # a failed step ends its requests, not the engine
            log.exception("step failed", step_id=msg.step_id)
            return StepFailed(step_id=msg.step_id, error=f"{type(exc).__name__}: {exc}",
                              kv_lost=getattr(exc, "kv_lost", False),
                              pool_blocks=getattr(exc, "pool_blocks", None))
