"""The scheduler actor: owns the live requests and the iteration loop.

Each iteration: freeze the requests into views, ask the policy for an order, fit it to the budgets
(engine/planner.py), send the whole plan to the allocator in one `RunStep` (engine/step_plan.py),
and wait for the executor's `StepFinished` while still taking new requests, cancellations and
policy swaps. Queues are request states: waiting, running, swapped (KV on the host), swapping_in.
Host copies, their reuse, the swap-in choice (FastSwitch §3.2-3.3) live in engine/memory/."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import assert_never

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.cluster.adoption import AdoptionMixin, GroupSeat
from engine.config import EngineConfig
from engine.cost_model import CostModel
from engine.memory.host_copies import HostCopies
from engine.memory.swap_in_profiler import SwapInProfiler
from engine.messages import (
    AbortRequest, AddRequest, AllocatorMessage, FrontendMessage, InspectScheduler, Regroup,
    ReplacePolicy, RunStep, SchedulerMessage, StepFailed, StepFinished, StepOutputs, SwapDone,
    TakeIterationLog, TokenOutput,
)
from engine.planner import Budget, IterationPlan, blocks_for, plan_iteration
from engine.policy import IterationOutcome, Policy, RequestView, SchedulerView
from engine.request import Request, held_blocks, refusal
from engine.scheduler_stats import SchedulerStats
from engine.step_plan import BidirectionalMemory, build_run_step, finish_step, land_swaps, start_step

log = structlog.get_logger(actor="scheduler")

IDLE_POLL_S = 0.005  # how long to wait before asking the policy again when it scheduled nothing


class Scheduler(AdoptionMixin):
    name = "scheduler"

    def __init__(self, *, config: EngineConfig, policy: Policy, num_blocks: int, max_context: int,
                 inbox: MemoryObjectReceiveStream[SchedulerMessage],
                 allocator: MemoryObjectSendStream[AllocatorMessage],
                 frontend: MemoryObjectSendStream[FrontendMessage], cost: CostModel | None = None,
                 cpu_blocks: int = 0, bidirectional: BidirectionalMemory | None = None) -> None:
        self._config, self._cost, self._bidi = config, cost, bidirectional
        self._total_blocks = num_blocks
        # a sequence longer than the whole KV pool could never be scheduled again; admission
        # refuses those unless they asked to be truncated, and they end with the limit's name
        pool = num_blocks * config.block_size
        self._max_context = min(max_context, pool)
        self._limit = "pool" if pool < max_context else "context"
        self._inbox, self._allocator, self._frontend = inbox, allocator, frontend
        self._live: dict[int, Request] = {}
        self._in_flight: dict[int, Request] = {}
        self._step_views: Mapping[int, RequestView] = {}  # what the policy saw for the step
        self._release: list[int] = []
        self._outputs: list[TokenOutput] = []
        self._turns: Counter[str] = Counter()  # conversation -> turns seen
        self._iteration, self._step_started, self._last_iteration_ms = 0, 0.0, 0.0
        self._stats = SchedulerStats(total_blocks=num_blocks, block_size=config.block_size,
                                     record_iterations=config.record_iterations, cost=cost,
                                     correction_window=config.correction_window)
        self._prefixes = self._stats.prefixes  # the device prefix cache (vLLM's APC)
        self._copies = HostCopies(cpu_blocks, config.block_size) if cpu_blocks else None
        self._profiler = SwapInProfiler()
        self._seat = GroupSeat()
        self._use(policy, version=1)

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
            if self._config.charge_scheduler_time:  # sim: planning's CPU time, on its clock
                await anyio.sleep(self._stats.last_scheduler_s * self._config.scheduler_time_scale)
            await self._allocator.send(self._with_regroup(step))
            await self._wait_for(step.step_id)
            self._regroups_after_step()

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
            case SwapDone():
                self._on_swap_done(msg)
            case Regroup():  # KunServe groups: engine/cluster/adoption.py
                self._regroup(msg)
            case InspectScheduler(reply=reply):
                reply.send(self._stats.snapshot(
                    iteration=self._iteration, policy=self._policy.settings.name,
                    policy_version=self._policy_version,
                    requests=self._live.values(), free_blocks=self._free_blocks(),
                    iteration_ms=self._last_iteration_ms, copies=self._copies))
            case TakeIterationLog(reply=reply):
                reply.send(self._stats.take_log(self._profiler, self._copies))
            case ReplacePolicy(policy=policy, version=version, reply=reply):
                log.info("policy replaced", old=self._policy.settings.name, new=policy.settings.name,
                         version=version)
                self._use(policy, version)
                reply.send(None)
            case _:
                assert_never(msg)
        if self._outputs:
            outputs, self._outputs = tuple(self._outputs), []
            await self._frontend.send(StepOutputs(time=anyio.current_time(), outputs=outputs))

    def _use(self, policy: Policy, version: int) -> None:
        self._policy, self._policy_version = policy, version
        self._prefixes.enabled = policy.settings.memory.prefix_cache
        if self._copies is not None:
            self._copies.use(policy.settings.memory)

    # ------------------------------------------------------------------------ requests

    def _add(self, msg: AddRequest) -> None:
        conversation, settings = msg.scheduling.conversation_id, self._policy.settings
        if conversation is not None:
            self._turns[conversation] += 1
        turn = self._turns[conversation] if conversation is not None else 1
        req = self._live[msg.request_id] = Request.admit(msg, settings, turn)
        error = refusal(msg, settings, self._live.values())
        if error is not None:
            self._finish(req, "error", error)
        elif self._copies is not None and conversation is not None:
            tokens = self._copies.reuse_turn(req.id, conversation, req.prompt_ids)
            if tokens:
                req.resume_from_host(tokens, blocks_for(tokens, self._config.block_size))

    def _abort(self, request_id: int, reason: str) -> None:
        req = self._live.get(request_id)
        if req is not None and req.abort_reason is None:  # counted once, where it was
            self._stats.note_cancel(req.state)
        if req is not None and req.in_flight_tokens:
            req.abort_reason = reason  # ends when its step comes back
        elif req is not None:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        del self._live[req.id]
        if self._copies is not None:
            self._copies.end_request(
                req.id, reason, conversation=req.conversation_id, blocks=req.blocks,
                computed_tokens=req.computed_tokens, prompt=req.prompt_ids, output=req.output_ids)
        if req.known_to_executor or req.blocks:
            self._release.append(req.id)
        self._outputs.append(TokenOutput(
            request_id=req.id, token_ids=(), finish_reason=reason, error=error,
            metrics=req.timeline(anyio.current_time(), reason)))

    def _free_blocks(self) -> int:  # held by no live request (a shared cached one counts once)
        used = held_blocks(self._live.values()) - self._prefixes.shared_extra
        return self._bidi.planning_free() if self._bidi else self._total_blocks - used

    # ------------------------------------------------------------------------ iterations

    def _view(self, now: float) -> SchedulerView:
        c = self._config
        return SchedulerView(
            now=now, iteration=self._iteration, requests=self._prefixes.views(self._live),
            free_blocks=self._free_blocks(), total_blocks=self._total_blocks,
            reverse_free_blocks=self._bidi.reverse_free() if self._bidi else None,
            block_size=c.block_size, max_num_seqs=c.max_num_seqs,  # a group's: adoption.py
            max_batched_tokens=c.max_batched_tokens * self._seat.stages,
            cost=self._stats.cost_model, last_iteration_ms=self._last_iteration_ms)

    def _next_step(self) -> RunStep | None:
        began = time.thread_time()
        now = anyio.current_time()
        view = self._view(now)
        decision = self._policy.decide(view)
        self._stats.note_overload(decision.overload, iteration=self._iteration,
                                  free_blocks=view.free_blocks)
        order, settings = list(decision.order), self._policy.settings
        swap_in_async = self._copies is not None and self._profiler.asynchronous(
            settings.memory.swap_in, order, max_num_seqs=view.max_num_seqs,
            iteration_ms=view.last_iteration_ms, free_blocks=view.free_blocks)
        plan = plan_iteration(decision, view.requests,
                              Budget.for_view(view, settings, async_swap_in=swap_in_async))
        if plan.forced:
            log.warning("forced a preemption: every running request was waiting for blocks",
                        request_id=plan.preempted[-1].id)
        # a pass over the whole queue: only preemptions, swap-ins and host backups read it
        copies = self._copies
        rank = ({r.id: i for i, r in enumerate(order)} if plan.preempted or plan.swapped_in
                or (copies is not None and copies.has_backups) else {})
        for v in plan.preempted:
            self._preempt(self._live[v.id], rank.get(v.id, len(order)))
        if copies is not None and copies.has_backups:
            copies.rank_backups(rank, len(order))
        orders = copies is not None and copies.has_orders()
        if not (plan.work or plan.swapped_in or plan.preempted or self._release or orders):
            return None
        step = self._start_step(plan, view, rank)
        self._stats.record_iteration(
            now=now, scheduler_s=time.thread_time() - began, batch_seqs=len(plan.work),
            batch_tokens=sum(plan.work.values()), queued=len(self._live) - len(plan.work),
            used_blocks=self._total_blocks - self._free_blocks(), seqs=step.seqs)
        return step

    def _preempt(self, req: Request, rank: int) -> None:
        """Preempt by swap when the policy says so and the host has room (only what no valid
        copy holds is copied, FastSwitch §3.3; BROS's table: engine/bidirectional_step.py);
        else by recompute: drop the KV, keep the tokens, prefill them again later."""
        req.preemptions += 1
        self._stats.preemptions += 1
        bs, copies = self._config.block_size, self._copies
        swap = self._policy.settings.preempt_mode == "swap"
        plan = self._bidi.swap_out(req.id) if swap and self._bidi else copies and copies.preempt(
            req.id, req.computed_tokens, rank=rank, swap=swap,
            expected_blocks=blocks_for(req.prompt_tokens + req.sampling.max_tokens, bs))
        if plan:
            req.swapped_out(blocks_for(req.computed_tokens, bs))
        else:
            req.recompute()
        log.debug("preempted", request_id=req.id, mode="swap" if plan else "recompute")

    def _start_step(self, plan: IterationPlan, view: SchedulerView, rank: dict[int, int]) -> RunStep:
        self._iteration += 1
        copies, live = self._copies, self._live
        swap_in_blocks = {v.id: copies.swap_in(v.id, v.swapped_blocks,
                                               valid_tokens=live[v.id].computed_tokens,
                                               rank=rank.get(v.id, len(rank)))
                          for v in plan.swapped_in} if copies is not None else {}
        self._prefixes.admit(plan, live)  # cache hits start their requests after the hit
        step = build_run_step(
            plan, step_id=self._iteration, requests=live, swap_in_blocks=swap_in_blocks,
            release=self._release, swap_out=copies.take_orders() if copies else (),
            granularity=self._policy.settings.memory.swap_granularity, bidirectional=self._bidi)
        self._release = []
        self._profiler.count(step.swap_in)
        self._in_flight = start_step(plan, step, live, view.now)
        self._step_started, self._step_views = view.now, plan.views
        return self._prefixes.attach_ops(step, live)

    def _on_step_finished(self, msg: StepFinished) -> None:
        now = anyio.current_time()
        result = finish_step(msg, self._in_flight, self._step_views, now,
                             max_context=self._max_context, limit=self._limit)
        for req, token, reason in result.events:
            if token is not None:
                self._outputs.append(TokenOutput(req.id, (token,)))
            if reason is not None:
                self._finish(req, reason)
        self._in_flight = {}
        self._last_iteration_ms = self._stats.step_done((now - self._step_started) * 1000.0)
        self._policy.observe(IterationOutcome(
            iteration=self._iteration, duration_ms=self._last_iteration_ms,
            served=result.served, deadline_misses=result.deadline_misses))

    def _on_swap_done(self, msg: SwapDone) -> None:
        """Asynchronous swap-ins that finished go back to the running batch."""
        for req in land_swaps(msg, self._live, self._copies, anyio.current_time()):
            self._finish(req, "error", f"copying its KV between device and host failed: {msg.error}")
        self._profiler.observe(msg.seconds_per_block)

    def _on_step_failed(self, msg: StepFailed) -> None:
        log.error("step failed", step_id=msg.step_id, error=msg.error)
        if msg.kv_lost:  # KunServe: recomputed, not failed (engine/cluster/adoption.py)
            self._in_flight = {}
            return self._lost_kv(msg.pool_blocks)
        for req in self._in_flight.values():
            self._finish(req, "error", f"the model step failed: {msg.error}")
        if self._bidi is not None:  # KV its slot copies carried for others: recomputed
            for req in self._bidi.step_failed(self._live, self._in_flight):
                log.warning("recomputed: its KV was in a failed step's copies", request_id=req.id)
        self._in_flight = {}
