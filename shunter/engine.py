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
from pathlib import Path
from typing import Protocol

import anyio
import attrs
import structlog
from anyio.streams.memory import MemoryObjectSendStream

from actors.allocator import Allocator
from actors.executor import Executor
from actors.frontend import Frontend, Limits
from actors.scheduler import Scheduler
from actors.swap_pool import Swapper, SwapPool
from engine.bidirectional_step import BidirectionalMemory
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.iteration_log import IterationLog, SwapCounters
from engine.logs import configure_default
from engine.memory.block_groups import BlockGroupManager
from engine.memory.block_pool import BlockPool
from engine.messages import (
    AllocatorMessage,
    Cancel,
    ExecutorMessage,
    FrontendMessage,
    InspectAllocator,
    InspectScheduler,
    InspectSwapPool,
    ReplacePolicy,
    SchedulerMessage,
    Submit,
    SwapPoolMessage,
    TakeIterationLog,
    TakeSwapCounters,
)
from engine.params import SamplingParams, SchedulingParams
from engine.policy import Policy
from engine.reply import Reply
from engine.snapshots import AllocatorSnapshot, EngineSnapshot, SchedulerSnapshot
from shunter.backends import Backend, build_backend
from shunter.client import Completion, GenerationStream, collect
from shunter.policy_source import (
    cpu_swap_blocks,
    engine_capabilities,
    initial_policy,
    replacement,
    source_diff,
)

log = structlog.get_logger(actor="engine")


class Actor(Protocol):
    """What the Engine supervises: every actor under actors/."""

    name: str

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None: ...


class _Started:
    """Wraps a task status so the supervisor knows whether an actor got through start-up."""

    def __init__(self, status: anyio.abc.TaskStatus) -> None:
        self._status = status
        self.done = False

    def started(self, value: object = None) -> None:
        self.done = True
        self._status.started(value)


class Engine:
    def __init__(self, config: EngineConfig, policy: Policy | None = None,
                 backend: Backend | None = None) -> None:
        self.backend = backend or build_backend(config)
        if self.backend.planning_scale is not None:  # a profile fitted net of the planning
            config = attrs.evolve(config, charge_scheduler_time=True,
                                  scheduler_time_scale=self.backend.planning_scale)
        self.config = config
        capabilities = engine_capabilities(config, self.backend)
        self._policy = initial_policy(config, policy, capabilities)
        self._policy_version = 1
        self.capabilities = capabilities.running(self._policy.settings)
        """The mechanisms this engine has, its device allocator included; policies needing
        others are refused."""
        self.swapper: Swapper | None = None
        """The swap pool's copier, when the engine can swap (made once the model is loaded,
        closed when the actors have stopped); only the swap pool actor reads it."""
        self._failure: str | None = None
        self._closed = False
        self._frontend_send: MemoryObjectSendStream[FrontendMessage] | None = None
        self._scheduler_send: MemoryObjectSendStream[SchedulerMessage] | None = None
        self._allocator_send: MemoryObjectSendStream[AllocatorMessage] | None = None
        self._swap_pool_send: MemoryObjectSendStream[SwapPoolMessage] | None = None
        self._actor_scope = anyio.CancelScope()

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, config: EngineConfig | None = None, *, policy: Policy | None = None,
                    backend: Backend | None = None) -> AsyncIterator[Engine]:
        """Load the model, start the actors, and stop them when the block exits. `backend`
        replaces the one `config` names (tests use it to plug in a fake model)."""
        configure_default()
        config = config or EngineConfig()
        engine = cls(config, policy, backend)
        body_error: Exception | None = None
        try:
            block_ids = await engine.backend.runner.start()
            if engine.capabilities.swap:
                engine.swapper = await engine.backend.runner.make_swapper(
                    engine._host_blocks(block_ids))
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
        finally:
            if engine.swapper is not None:
                engine.swapper.close()
            close_runner = getattr(engine.backend.runner, "close", None)
            if close_runner is not None:
                close_runner()
        if body_error is not None:
            raise body_error

    def _host_blocks(self, block_ids: range) -> int:
        """Host KV blocks: `cpu_swap_blocks`, by default as many as the device has, twice that
        for bidirectional blocks with preempt swap (checkpoints and whole requests, half each)."""
        twice = self.capabilities.bidirectional_swap and self.config.cpu_swap_blocks is None
        return cpu_swap_blocks(self.config, block_ids) * (2 if twice else 1)

    async def _run_actors(self, block_ids: range, *,
                          task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        c, b = self.config, self.backend
        front_send, front_recv = anyio.create_memory_object_stream[FrontendMessage](math.inf)
        sched_send, sched_recv = anyio.create_memory_object_stream[SchedulerMessage](c.inbox_size)
        alloc_send, alloc_recv = anyio.create_memory_object_stream[AllocatorMessage](c.inbox_size)
        exec_send, exec_recv = anyio.create_memory_object_stream[ExecutorMessage](c.inbox_size)
        swap_send, swap_recv = anyio.create_memory_object_stream[SwapPoolMessage](c.inbox_size)
        # The frontend's inbox is unbounded so that the scheduler never blocks on it: the
        # frontend -> scheduler -> frontend cycle cannot deadlock. Admission bounds its size.
        pool_tokens = len(block_ids) * c.block_size
        limits = Limits(
            vocab_size=b.vocab_size, max_prompt_tokens=b.max_prompt_tokens,
            pool_tokens=pool_tokens, max_queued_requests=c.max_queued_requests,
            eos_token_ids=b.eos_token_ids, max_context=b.max_context, block_size=c.block_size)
        # The device allocator follows the swap granularity of the policy the engine starts
        # with: block groups make a request's KV a few contiguous runs (FastSwitch §3.1).
        groups = self.capabilities.allocator == "groups"
        pool = BlockGroupManager(block_ids) if groups else BlockPool(block_ids)
        swapping = self.swapper is not None
        # BROS §5: with bidirectional blocks the scheduler's table places KV slot by slot and
        # keeps its lazy checkpoints in the host swap space, which host copies then do not use;
        # a policy that preempts by swap gets half of it for whole requests (slot_swap.py)
        host = self._host_blocks(block_ids) if swapping else 0
        whole = host // 2 if self.capabilities.bidirectional_swap else 0
        bidi = (BidirectionalMemory(block_ids, c.block_size, (host - whole) * c.block_size,
                                    range(host - whole, host) if whole else None)
                if host and self.capabilities.bidirectional else None)
        actors: list[Actor] = [
            Executor(runner=b.runner, inbox=exec_recv, scheduler=sched_send),
            Allocator(pool=pool, inbox=alloc_recv, executor=exec_send, block_size=c.block_size,
                      swap_pool=swap_send if swapping else None),
            Scheduler(config=c, policy=self._policy, num_blocks=len(block_ids),
                      max_context=b.max_context, inbox=sched_recv, allocator=alloc_send,
                      frontend=front_send, cost=b.cost_model,
                      cpu_blocks=0 if bidi else host, bidirectional=bidi),
            Frontend(codec=b.codec, limits=limits, inbox=front_recv, scheduler=sched_send),
        ]
        if self.swapper is not None:
            actors.append(SwapPool(swapper=self.swapper, inbox=swap_recv, executor=exec_send,
                                   scheduler=sched_send))
            self._swap_pool_send = swap_send
        self._frontend_send, self._scheduler_send, self._allocator_send = front_send, sched_send, alloc_send
        with self._actor_scope:
            async with anyio.create_task_group() as tg:
                for actor in actors:
                    await tg.start(self._supervise, actor)
                task_status.started()

    async def _supervise(self, actor: Actor, *,
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
        """The whole result of one request (delivered in one chunk, not streamed)."""
        return await collect(GenerationStream(self, prompt, params or SamplingParams(),
                                              scheduling or SchedulingParams(), stream=False))

    async def inspect(self) -> EngineSnapshot:
        """Queues, block usage and swap traffic so far, asked of the actors that own them;
        nothing is reset, so a scraper may call it as often as it likes."""
        self._check_alive()
        sched, alloc = Reply[SchedulerSnapshot](), Reply[AllocatorSnapshot]()
        await self._scheduler_send.send(InspectScheduler(reply=sched))
        await self._allocator_send.send(InspectAllocator(reply=alloc))
        swap = None
        if self._swap_pool_send is not None:
            swapped = Reply[SwapCounters]()
            await self._swap_pool_send.send(InspectSwapPool(reply=swapped))
            swap = await swapped.wait()
        return EngineSnapshot(scheduler=await sched.wait(), allocator=await alloc.wait(), swap=swap)

    async def take_iteration_log(self) -> IterationLog | None:
        """The scheduler's per-iteration log since the last call (None unless the config sets
        `record_iterations`)."""
        self._check_alive()
        reply = Reply[IterationLog | None]()
        await self._scheduler_send.send(TakeIterationLog(reply=reply))
        taken = await reply.wait()
        if taken is not None and self._swap_pool_send is not None:
            swapped = Reply[SwapCounters]()
            await self._swap_pool_send.send(TakeSwapCounters(reply=swapped))
            taken.swap = taken.swap.plus(await swapped.wait())
        return taken

    async def wait_idle(self, poll_s: float = 0.01) -> EngineSnapshot:
        """Wait until no request is live and no KV block is allocated."""
        while not (snap := await self.inspect()).idle:
            await anyio.sleep(poll_s)
        return snap

    async def replace_policy(self, policy: Policy | str, *, base_dir: Path | None = None) -> Policy:
        """Run `policy` (a policy, or policy text compiled for this engine) from the next
        iteration on, and return it. A policy that fails to compile, needs a mechanism this
        engine lacks, or swaps at another granularity than the device allocator runs (the one
        the engine started with) raises PolicyError, and the running one stays."""
        self._check_alive()
        new = replacement(policy, self._policy, self.capabilities, base_dir)
        reply = Reply[None]()
        version = self._policy_version + 1
        await self._scheduler_send.send(ReplacePolicy(policy=new, version=version, reply=reply))
        await reply.wait()
        self._policy_version = version
        log.info("policy replaced", old=self._policy.settings.name, new=new.settings.name,
                 version=self._policy_version, diff=source_diff(self._policy, new))
        self._policy = new
        return new

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def policy_version(self) -> int:
        """1 for the policy the engine started with, +1 per replacement (rollbacks included)."""
        return self._policy_version

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving (an actor failed, or it shut down), or None."""
        if self._failure or self._closed:
            return self.stopped_reason()
        return None

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
