"""The scheduler actor: owns the request queues and the iteration loop.

Each iteration: refresh the views, ask the policy for an order, fit it to the budgets
(engine/planner.py), send the whole plan to the allocator in one `RunStep`, and wait for the
executor's `StepFinished` while still taking new requests, cancellations and policy swaps.
"""

from __future__ import annotations

from typing import assert_never

import anyio
import attrs
import structlog

from engine.config import EngineConfig
from engine.cost_model import CostModel
from engine.messages import (
    AbortRequest, AddRequest, InspectScheduler, ReplacePolicy, RequestSetup, RunStep, SchedulerMessage,
    SeqWork, StepFailed, StepFinished, StepOutputs, TokenOutput,
)
from engine.planner import Budget, IterationPlan, plan_iteration
from engine.policy import IterationOutcome, Policy, RequestView, SchedulerView
from engine.request import Request

log = structlog.get_logger().bind(actor="scheduler")

IDLE_POLL_S = 0.005
"""How long to wait before asking the policy again when it scheduled nothing."""


@attrs.frozen(kw_only=True)
class SchedulerSnapshot:
    iteration: int
    policy: str
    waiting: int
    running: int
    swapped: int
    free_blocks: int
    total_blocks: int
    live_requests: tuple[int, ...]
    preemptions: int
    iteration_ms: float


class Scheduler:
    name = "scheduler"

    def __init__(self, *, config: EngineConfig, policy: Policy, num_blocks: int, max_context: int,
                 inbox: anyio.abc.ObjectReceiveStream, allocator: anyio.abc.ObjectSendStream,
                 frontend: anyio.abc.ObjectSendStream, cost: CostModel | None = None) -> None:
        self._config = config
        self._cost = cost
        self._policy = policy
        self._total_blocks = num_blocks
        self._free_blocks = num_blocks
        self._max_context = max_context
        self._inbox = inbox
        self._allocator = allocator
        self._frontend = frontend
        self._live: dict[int, Request] = {}
        self._release: list[int] = []
        self._outputs: list[TokenOutput] = []
        self._turns: dict[str, int] = {}
        self._iteration = 0
        self._in_flight: dict[int, Request] = {}
        self._step_started = 0.0
        self._last_iteration_ms = 0.0
        self._preemptions = 0

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if not self._live and not self._release:
                await self._handle(await self._inbox.receive())
                continue
            await self._drain()
            step = self._next_step()
            if step is None:
                with anyio.move_on_after(IDLE_POLL_S):
                    await self._handle(await self._inbox.receive())
                continue
            await self._allocator.send(step)
            await self._wait_for(step.step_id)

    async def _drain(self) -> None:
        while True:
            try:
                msg = self._inbox.receive_nowait()
            except anyio.WouldBlock:
                return
            await self._handle(msg)

    async def _wait_for(self, step_id: int) -> None:
        """Handle messages until the executor reports on step `step_id`."""
        while True:
            msg = await self._inbox.receive()
            await self._handle(msg)
            if isinstance(msg, (StepFinished, StepFailed)) and msg.step_id == step_id:
                return

    async def _handle(self, msg: SchedulerMessage) -> None:
        match msg:
            case AddRequest():
                self._add(msg)
            case AbortRequest(request_id=rid, reason=reason):
                self._abort(rid, reason)
            case StepFinished():
                self._on_step_finished(msg)
            case StepFailed():
                self._on_step_failed(msg)
            case InspectScheduler(reply=reply):
                reply.send(self._snapshot())
            case ReplacePolicy(policy=policy, reply=reply):
                log.info("policy replaced", old=self._policy.settings.name, new=policy.settings.name)
                self._policy = policy
                reply.send(None)
            case _:
                assert_never(msg)
        await self._flush_outputs()

    # ------------------------------------------------------------------------ requests

    def _add(self, msg: AddRequest) -> None:
        sched, settings = msg.scheduling, self._policy.settings
        spec = settings.class_spec(sched.request_class)
        turn = 1
        if sched.conversation_id is not None:
            turn = self._turns.get(sched.conversation_id, 0) + 1
            self._turns[sched.conversation_id] = turn
        view = RequestView(
            id=msg.request_id, request_class=spec.name if spec else str(sched.request_class),
            priority=sched.priority, tenant=sched.tenant, conversation_id=sched.conversation_id,
            turn=turn, arrival=msg.arrival, prompt_tokens=len(msg.prompt_ids),
            max_tokens=msg.sampling.max_tokens,
            ttft_ms=sched.ttft_ms or (spec.ttft_ms if spec else None),
            tpot_ms=sched.tpot_ms or (spec.tpot_ms if spec else None),
        )
        stop = set(msg.sampling.stop_token_ids)
        if not msg.sampling.ignore_eos:
            stop.update(msg.eos_token_ids)
        req = Request(view=view, prompt_ids=msg.prompt_ids, sampling=msg.sampling,
                      stop_ids=frozenset(stop), eos_token_ids=msg.eos_token_ids)
        self._live[view.id] = req
        if spec is None:
            declared = ", ".join(c.name for c in settings.classes)
            self._finish(req, "error", f"unknown request class {sched.request_class!r} "
                                       f"(policy {settings.name} declares: {declared})")

    def _abort(self, request_id: int, reason: str) -> None:
        req = self._live.get(request_id)
        if req is None:
            return
        if req.in_flight:
            req.aborted = reason
        else:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        now = anyio.current_time()
        del self._live[req.id]
        self._free_blocks += req.view.blocks
        if req.known_to_executor or req.view.blocks:
            self._release.append(req.id)
        self._outputs.append(TokenOutput(
            request_id=req.id, token_ids=(), finish_reason=reason, error=error,
            metrics=req.timeline(now, reason)))

    async def _flush_outputs(self) -> None:
        if self._outputs:
            outputs, self._outputs = tuple(self._outputs), []
            await self._frontend.send(StepOutputs(time=anyio.current_time(), outputs=outputs))

    # ------------------------------------------------------------------------ iterations

    def _view(self, now: float) -> SchedulerView:
        views = [r.view for r in self._live.values()]
        for v in views:
            v.refresh(now)
        c = self._config
        return SchedulerView(
            now=now, iteration=self._iteration, requests=views, free_blocks=self._free_blocks,
            total_blocks=self._total_blocks, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
            max_batched_tokens=c.max_batched_tokens, last_iteration_ms=self._last_iteration_ms,
            cost=self._cost,
        )

    def _budget(self) -> Budget:
        s, c = self._policy.settings, self._config
        return Budget(
            free_blocks=self._free_blocks, total_blocks=self._total_blocks,
            block_size=c.block_size, max_num_seqs=c.max_num_seqs,
            max_batched_tokens=c.max_batched_tokens, can_preempt=s.preempt_mode != "never",
            max_running={k.name: k.max_running for k in s.classes if k.max_running is not None},
        )

    def _next_step(self) -> RunStep | None:
        now = anyio.current_time()
        view = self._view(now)
        plan = plan_iteration(self._policy.decide(view), view.requests, self._budget())
        if plan.forced:
            log.warning("forced a preemption: every running request was waiting for blocks",
                        request_id=plan.preempted[-1].id)
        for v in plan.preempted:
            self._preempt(self._live[v.id])
        if not plan.work and not self._release and not plan.preempted:
            return None
        return self._build_step(plan, now)

    def _preempt(self, req: Request) -> None:
        """Preempt by recompute: drop the KV, keep the tokens, prefill them again later."""
        v = req.view
        self._free_blocks += v.blocks
        v.blocks, v.computed_tokens, v.state = 0, 0, "waiting"
        v.preemptions += 1
        self._preemptions += 1
        log.debug("preempted", request_id=v.id, mode="recompute")

    def _build_step(self, plan: IterationPlan, now: float) -> RunStep:
        self._iteration += 1
        setups, seqs = [], []
        for rid, n in plan.work.items():
            req = self._live[rid]
            v = req.view
            if not req.known_to_executor:
                req.known_to_executor = True
                setups.append(RequestSetup(request_id=rid, prompt_ids=req.prompt_ids,
                                           sampling=req.sampling, eos_token_ids=req.eos_token_ids))
            seqs.append(SeqWork(request_id=rid, start=v.computed_tokens, num_tokens=n,
                                sample=v.computed_tokens + n == v.context_tokens))
            self._free_blocks -= plan.grow[rid] - v.blocks
            v.blocks = plan.grow[rid]
            v.state = "running"
            req.in_flight = n
            req.first_scheduled = req.first_scheduled or now
            self._in_flight[rid] = req
        step = RunStep(step_id=self._iteration, release=tuple(self._release),
                       preempt=tuple(v.id for v in plan.preempted), grow=tuple(plan.grow.items()),
                       setups=tuple(setups), seqs=tuple(seqs))
        self._release = []
        self._step_started = now
        return step

    def _on_step_finished(self, msg: StepFinished) -> None:
        now = anyio.current_time()
        sampled = {s.request_id: s.token_id for s in msg.sampled}
        served, misses = [], 0
        for rid, req in self._in_flight.items():
            v, n = req.view, req.in_flight
            req.in_flight = 0
            v.computed_tokens += n
            v.last_scheduled_at = now
            token = sampled.get(rid)
            if req.aborted is not None:
                self._finish(req, req.aborted)
                continue
            if token is None:
                served.append((v, n, 0))
                continue
            misses += now > v.next_deadline()
            req.output_ids.append(token)
            req.token_times.append(now)
            v.output_tokens += 1
            v.first_token_at = v.first_token_at or now
            v.last_token_at = now
            served.append((v, n - 1, 1))
            self._outputs.append(TokenOutput(request_id=rid, token_ids=(token,)))
            reason = req.stop_reason(token, self._max_context)
            if reason is not None:
                self._finish(req, reason)
        self._in_flight = {}
        self._last_iteration_ms = (now - self._step_started) * 1000.0
        self._step_started = 0.0
        self._policy.observe(IterationOutcome(
            iteration=self._iteration, duration_ms=self._last_iteration_ms,
            served=served, deadline_misses=misses))

    def _on_step_failed(self, msg: StepFailed) -> None:
        log.error("step failed", step_id=msg.step_id, error=msg.error)
        for req in self._in_flight.values():
            req.in_flight = 0
            self._finish(req, "error", f"the model step failed: {msg.error}")
        self._in_flight = {}
        self._step_started = 0.0

    def _snapshot(self) -> SchedulerSnapshot:
        states = [r.view.state for r in self._live.values()]
        return SchedulerSnapshot(
            iteration=self._iteration, policy=self._policy.settings.name,
            waiting=states.count("waiting"), running=states.count("running"),
            swapped=states.count("swapped"), free_blocks=self._free_blocks,
            total_blocks=self._total_blocks, live_requests=tuple(self._live),
            preemptions=self._preemptions, iteration_ms=self._last_iteration_ms,
        )
