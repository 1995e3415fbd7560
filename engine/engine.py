"""The Engine: builds the actors, wires their inboxes, and supervises them in one task group.

    async with Engine.start(EngineConfig()) as engine:
        async for chunk in engine.generate("def fib(n):", SamplingParams(max_tokens=32)):
            print(chunk.text, end="")

Works under asyncio and trio (everything goes through anyio). An actor that fails stops the
engine: every live request's stream ends with `EngineDeadError` naming the actor and the error.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import attrs
import structlog

from actors.allocator import Allocator, AllocatorSnapshot
from actors.executor import Executor
from actors.frontend import Frontend, Limits
from actors.scheduler import Scheduler, SchedulerSnapshot
from engine.backends import Backend, build_backend
from engine.client import Completion, GenerationStream, collect
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.memory.block_pool import BlockPool
from engine.messages import Cancel, InspectAllocator, InspectScheduler, ReplacePolicy, Submit
from engine.params import SamplingParams, SchedulingParams
from engine.policy import FcfsPolicy, Policy
from engine.reply import Reply

log = structlog.get_logger().bind(actor="engine")


@attrs.frozen(kw_only=True)
class EngineSnapshot:
    scheduler: SchedulerSnapshot
    allocator: AllocatorSnapshot

    @property
    def idle(self) -> bool:
        return not self.scheduler.live_requests and self.allocator.allocated_blocks == 0


class _Started:
    """Wraps a task status so the supervisor knows whether an actor got through start-up."""

    def __init__(self, status: anyio.abc.TaskStatus) -> None:
        self._status = status
        self.done = False

    def started(self, value: Any = None) -> None:
        self.done = True
        self._status.started(value)


class Engine:
    def __init__(self, config: EngineConfig, policy: Policy, backend: Backend | None = None) -> None:
        self.config = config
        self.backend = backend or build_backend(config)
        self._policy = policy
        self._failure: str | None = None
        self._closed = False
        self._frontend_send: anyio.abc.ObjectSendStream | None = None
        self._scheduler_send: anyio.abc.ObjectSendStream | None = None
        self._allocator_send: anyio.abc.ObjectSendStream | None = None
        self._actor_scope = anyio.CancelScope()

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, config: EngineConfig | None = None, *, policy: Policy | None = None,
                    backend: Backend | None = None) -> AsyncIterator[Engine]:
        """Load the model, start the actors, and stop them when the block exits. `backend`
        replaces the one `config` names (tests use it to plug in a fake model)."""
        engine = cls(config or EngineConfig(), policy or FcfsPolicy(), backend)
        block_ids = await engine.backend.runner.start()
        body_error: Exception | None = None
        async with anyio.create_task_group() as tg:
            await tg.start(engine._run_actors, block_ids)
            try:
                yield engine
            except Exception as exc:
                # re-raised below, outside the task group, so the caller gets it unwrapped
                body_error = exc
            finally:
                engine._closed = True
                engine._actor_scope.cancel()
        if body_error is not None:
            raise body_error

    async def _run_actors(self, block_ids: range, *,
                          task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        c, b = self.config, self.backend
        front_send, front_recv = anyio.create_memory_object_stream[Any](math.inf)
        sched_send, sched_recv = anyio.create_memory_object_stream[Any](c.inbox_size)
        alloc_send, alloc_recv = anyio.create_memory_object_stream[Any](c.inbox_size)
        exec_send, exec_recv = anyio.create_memory_object_stream[Any](c.inbox_size)
        # The frontend's inbox is unbounded so that the scheduler never blocks on it: the
        # frontend -> scheduler -> frontend cycle cannot deadlock. Admission bounds its size.
        pool_tokens = len(block_ids) * c.block_size
        limits = Limits(
            vocab_size=b.vocab_size, max_prompt_tokens=b.max_prompt_tokens,
            pool_tokens=pool_tokens, max_queued_requests=c.max_queued_requests,
            eos_token_ids=b.eos_token_ids)
        actors = [
            Executor(runner=b.runner, inbox=exec_recv, scheduler=sched_send),
            Allocator(pool=BlockPool(block_ids), inbox=alloc_recv, executor=exec_send),
            Scheduler(config=c, policy=self._policy, num_blocks=len(block_ids),
                      max_context=b.max_context, inbox=sched_recv, allocator=alloc_send,
                      frontend=front_send, cost=b.cost_model),
            Frontend(codec=b.codec, limits=limits, inbox=front_recv, scheduler=sched_send),
        ]
        self._frontend_send, self._scheduler_send, self._allocator_send = front_send, sched_send, alloc_send
        with self._actor_scope:
            async with anyio.create_task_group() as tg:
                for actor in actors:
                    await tg.start(self._supervise, actor)
                task_status.started()

    async def _supervise(self, actor: Any, *,
                         task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        status = _Started(task_status)
        try:
            await actor.run(task_status=status)
        except Exception as exc:
            if not status.done:
                raise
            self._failure = f"the {actor.name} actor failed: {type(exc).__name__}: {exc}"
            log.exception("actor failed; stopping the engine", failed=actor.name)
            self._actor_scope.cancel()

    # ------------------------------------------------------------------------ client API

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 scheduling: SchedulingParams | None = None) -> GenerationStream:
        """Stream a request's tokens and text. `prompt` is text or token ids."""
        return GenerationStream(self, prompt, params or SamplingParams(),
                                scheduling or SchedulingParams())

    async def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       scheduling: SchedulingParams | None = None) -> Completion:
        """The whole result of one request."""
        return await collect(self.generate(prompt, params, scheduling=scheduling))

    async def inspect(self) -> EngineSnapshot:
        """Queues and block usage, asked of the actors that own them."""
        self._check_alive()
        sched, alloc = Reply[SchedulerSnapshot](), Reply[AllocatorSnapshot]()
        await self._scheduler_send.send(InspectScheduler(reply=sched))
        await self._allocator_send.send(InspectAllocator(reply=alloc))
        return EngineSnapshot(scheduler=await sched.wait(), allocator=await alloc.wait())

    async def wait_idle(self, poll_s: float = 0.01) -> EngineSnapshot:
        """Wait until no request is live and no KV block is allocated."""
        while not (snap := await self.inspect()).idle:
            await anyio.sleep(poll_s)
        return snap

    async def replace_policy(self, policy: Policy) -> None:
        """Run `policy` from the next iteration on."""
        self._check_alive()
        reply = Reply[None]()
        await self._scheduler_send.send(ReplacePolicy(policy=policy, reply=reply))
        await reply.wait()
        self._policy = policy

    @property
    def policy(self) -> Policy:
        return self._policy

    def stopped_reason(self) -> str:
        if self._failure:
            return self._failure
        return "the engine shut down" if self._closed else "the engine stopped"

    def _check_alive(self) -> None:
        if self._failure or self._closed or self._frontend_send is None:
            raise EngineDeadError(self.stopped_reason())

    async def _submit(self, msg: Submit) -> None:
        self._check_alive()
        try:
            await self._frontend_send.send(msg)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise EngineDeadError(self.stopped_reason()) from None

    def _cancel_nowait(self, request_id: int) -> None:
        if self._frontend_send is not None and not self._closed:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._frontend_send.send_nowait(Cancel(request_id=request_id))
