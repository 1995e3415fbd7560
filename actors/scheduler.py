"""The scheduler actor: owns the request queues and the iteration loop.

Each iteration: refresh the views, ask the policy for an order, fit it to the budgets
(engine/planner.py), send the whole plan to the allocator in one `RunStep`, and wait for the
executor's `StepFinished` while still taking new requests, cancellations and policy swaps.

Queues are request states: waiting, running, swapped (KV on the host) and swapping_in (an
asynchronous swap-in under way). When the policy re-ranks, the planner moves requests between
them in priority order; the swaps that causes ride in the same `RunStep`. The scheduler also owns
the host copy space (`CpuCopyStore`): which host blocks hold whose KV, what is reused across
swaps and conversation turns (FastSwitch §3.3), and whether a swap-out fits at all (else the
victim is preempted by recompute).
"""

from __future__ import annotations

import math
import time
from typing import assert_never

import anyio
import structlog

from engine.config import EngineConfig
from engine.cost_model import CostModel
from engine.iteration_log import IterationLog, SwapCounters
from engine.memory.cpu_store import CpuCopyStore, SwapOutPlan
from engine.messages import (
    AbortRequest,
    AddRequest,
    InspectScheduler,
    ReplacePolicy,
    RequestSetup,
    RunStep,
    SchedulerMessage,
    SeqWork,
    StepFailed,
    StepFinished,
    StepOutputs,
    SwapDone,
    SwapIn,
    SwapOut,
    TakeIterationLog,
    TokenOutput,
)
from engine.planner import Budget, IterationPlan, blocks_for, plan_iteration
from engine.policy import IterationOutcome, Policy, RequestView, SchedulerView
from engine.request import Request
from engine.snapshots import SchedulerSnapshot

log = structlog.get_logger(actor="scheduler")

IDLE_POLL_S = 0.005
"""How long to wait before asking the policy again when it scheduled nothing."""

SYNC_SWAP_IN_SHARE = 0.25
"""Adaptive swap-in (FastSwitch §3.2's profiler) swaps in synchronously when the swap-ins that
could happen this iteration are predicted to take at most this share of an iteration: a short
stall beats making the request wait an iteration more."""

SWAP_RATE_SMOOTHING = 0.2
"""Weight of the newest measurement in the running mean of seconds per swapped-in block."""


class Scheduler:
    name = "scheduler"

    def __init__(self, *, config: EngineConfig, policy: Policy, num_blocks: int, max_context: int,
                 inbox: anyio.abc.ObjectReceiveStream, allocator: anyio.abc.ObjectSendStream,
                 frontend: anyio.abc.ObjectSendStream, cost: CostModel | None = None,
                 cpu_blocks: int = 0) -> None:
        self._config = config
        self._cost = cost
        self._policy = policy
        self._total_blocks = num_blocks
        self._free_blocks = num_blocks
        # a sequence longer than the whole KV pool could never be scheduled again: it ends
        # with `length` there, as at the model's context limit
        self._max_context = min(max_context, num_blocks * config.block_size)
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
        self._overload: str | None = None
        self._overload_fired = {"drop": 0, "restore": 0}
        self._log = IterationLog(total_blocks=num_blocks) if config.record_iterations else None
        # swapping (FastSwitch): CPU copies, this iteration's orders, reuse across turns
        self._cpu = CpuCopyStore(range(cpu_blocks), config.block_size) if cpu_blocks else None
        self._swap_out: list[SwapOut] = []
        self._backups: set[int] = set()
        """Requests on the device that also have a CPU copy (ranked every iteration)."""
        self._conversations: dict[str, tuple[int, ...]] = {}
        """Tokens of each conversation's last ended turn whose KV is kept on the CPU."""
        self._seconds_per_block: float | None = None
        self._swap_counts = SwapCounters()
        """Swap events only the scheduler sees (reuse, turn-end copies, sync/async swap-ins);
        the swapper counts copies and bytes."""

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
            case SwapDone():
                self._on_swap_done(msg)
            case InspectScheduler(reply=reply):
                reply.send(self._snapshot())
            case TakeIterationLog(reply=reply):
                reply.send(self._take_log())
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
        elif spec.max_queued is not None and self._queued(spec.name) > spec.max_queued:
            self._finish(req, "error", f"class {spec.name} already has {spec.max_queued} queued "
                                       f"requests (max_queued in policy {settings.name})")
        elif self._reusing() and sched.conversation_id is not None:
            self._reuse_turn(req, sched.conversation_id)

    def _reusing(self) -> bool:
        return self._cpu is not None and self._policy.settings.memory.kv_reuse

    def _reuse_turn(self, req: Request, conversation: str) -> None:
        """A conversation's next turn starts from its last turn's CPU copy: the prefix both
        share is swapped in, not prefilled again (FastSwitch §3.3). Only whole blocks of valid,
        identical tokens are taken, and at least one prompt token is left to compute."""
        key = ("conversation", conversation)
        earlier = self._conversations.pop(conversation, None)
        copy = self._cpu.get(key)
        if copy is None or earlier is None:
            if copy is not None:
                self._cpu.drop(key)
            return
        prompt = req.prompt_ids
        limit = min(copy.valid_tokens, len(earlier), len(prompt) - 1)
        same = 0
        while same < limit and prompt[same] == earlier[same]:
            same += 1
        keep = same // self._config.block_size
        if keep == 0:
            self._cpu.drop(key)
            return
        v = req.view
        self._cpu.rekey(key, v.id)
        self._cpu.keep_prefix(v.id, keep * self._config.block_size, rank=0.0)
        v.state, v.computed_tokens, v.swapped_blocks = "swapped", keep * self._config.block_size, keep
        self._swap_counts.turn_prefix_blocks += keep

    def _queued(self, request_class: str) -> int:
        """Live requests of a class that are not running."""
        return sum(1 for r in self._live.values()
                   if r.view.request_class == request_class and r.view.state != "running")

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
        if self._cpu is not None:
            self._keep_or_drop_copy(req, reason)
        self._free_blocks += req.view.blocks
        if req.known_to_executor or req.view.blocks:
            self._release.append(req.id)
        self._outputs.append(TokenOutput(
            request_id=req.id, token_ids=(), finish_reason=reason, error=error,
            metrics=req.timeline(now, reason)))

    def _keep_or_drop_copy(self, req: Request, reason: str) -> None:
        """When a conversation's turn ends, its KV stays on the CPU for the next turn (only the
        part no valid copy holds yet is copied); any other ending drops the request's copy."""
        v = req.view
        self._backups.discard(v.id)
        conversation = v.conversation_id
        if (self._reusing() and conversation is not None and reason in ("stop", "length")
                and v.blocks and v.computed_tokens):
            plan = self._order_swap_out(v, rank=math.inf)
            if plan is not None:
                self._swap_counts.turn_end_blocks_out += len(plan.cpu_blocks)
                self._cpu.mark_backup(v.id, rank=math.inf)
                self._cpu.rekey(v.id, ("conversation", conversation))
                tokens = (*req.prompt_ids, *req.output_ids)
                self._conversations[conversation] = tokens[:v.computed_tokens]
                self._forget_lost_conversations()
                return
        self._cpu.drop(v.id)

    def _drop_conversation_copies(self) -> None:
        for conversation in self._conversations:
            self._cpu.drop(("conversation", conversation))
        self._conversations.clear()

    def _forget_lost_conversations(self) -> None:
        """Drop the tokens of conversations whose CPU copy was taken by others since."""
        if len(self._conversations) > 2 * len(self._cpu.keys()):
            kept = set(self._cpu.keys())
            self._conversations = {c: t for c, t in self._conversations.items()
                                   if ("conversation", c) in kept}

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

    def _budget(self, async_swap_in: bool = False) -> Budget:
        s, c = self._policy.settings, self._config
        return Budget(
            free_blocks=self._free_blocks, total_blocks=self._total_blocks,
            block_size=c.block_size, max_num_seqs=c.max_num_seqs,
            max_batched_tokens=c.max_batched_tokens, can_preempt=s.preempt_mode != "never",
            max_running={k.name: k.max_running for k in s.classes if k.max_running is not None},
            async_swap_in=async_swap_in,
        )

    def _async_swap_in(self, order: list) -> bool:
        """Swap in asynchronously this iteration? `sync` and `async` say; `adaptive` asks the
        profile of recent swap-ins (FastSwitch §3.2): synchronously when what could come back
        now is predicted to cost a small share of an iteration, else asynchronously."""
        mode = self._policy.settings.memory.swap_in
        if mode != "adaptive":
            return mode == "async"
        if self._seconds_per_block is None or not self._last_iteration_ms:
            return True
        candidates = [r for r in order[:self._config.max_num_seqs] if r.state == "swapped"]
        if not candidates:
            return True
        predicted = self._seconds_per_block * sum(r.swapped_blocks for r in candidates)
        return predicted > SYNC_SWAP_IN_SHARE * self._last_iteration_ms / 1000.0

    def _next_step(self) -> RunStep | None:
        began = time.perf_counter()
        now = anyio.current_time()
        view = self._view(now)
        decision = self._policy.decide(view)
        if decision.overload != self._overload:
            self._note_overload(decision.overload)
        order = list(decision.order)
        swaps = self._cpu is not None and any(r.state == "swapped" for r in order)
        budget = self._budget(swaps and self._async_swap_in(order))
        plan = plan_iteration(decision, view.requests, budget)
        if plan.forced:
            log.warning("forced a preemption: every running request was waiting for blocks",
                        request_id=plan.preempted[-1].id)
        rank = {r.id: i for i, r in enumerate(order)}
        for v in plan.preempted:
            self._preempt(self._live[v.id], rank.get(v.id, len(order)))
        for rid in self._backups:
            self._cpu.set_rank(rid, rank.get(rid, len(order)))
        if not (plan.work or plan.swapped_in or plan.preempted or self._release or self._swap_out):
            return None
        step = self._build_step(plan, now, rank)
        if self._log is not None:
            self._log.add(now=now, scheduler_s=time.perf_counter() - began,
                          batch_seqs=len(plan.work), batch_tokens=sum(plan.work.values()),
                          queued=len(self._live) - len(plan.work),
                          used_blocks=self._total_blocks - self._free_blocks)
        return step

    def _take_log(self) -> IterationLog | None:
        taken = self._log
        if taken is not None:
            taken.preemptions = self._preemptions
            taken.swap = self._swap_counts
            self._swap_counts = SwapCounters()
            self._log = IterationLog(total_blocks=self._total_blocks)
        return taken

    def _note_overload(self, signal: str | None) -> None:
        """Until the cluster coordinator acts on them, overload triggers are counted and logged
        when they start and stop firing."""
        if self._overload is not None:
            log.info("overload trigger stopped firing", trigger=self._overload,
                     iteration=self._iteration)
        if signal is not None:
            self._overload_fired[signal] += 1
            log.info("overload trigger fired", trigger=signal, iteration=self._iteration,
                     free_blocks=self._free_blocks, total_blocks=self._total_blocks)
        self._overload = signal

    def _order_swap_out(self, v: RequestView, *, rank: float,
                        expected_blocks: int | None = None) -> SwapOutPlan | None:
        """Make room on the host for the request's computed KV and order the copy of what no
        valid CPU copy holds yet; None (nothing ordered) when the host has no room."""
        plan = self._cpu.prepare_swap_out(v.id, v.computed_tokens, rank=rank,
                                          expected_blocks=expected_blocks)
        if plan is not None:
            self._swap_out.append(SwapOut(request_id=v.id, first_block=plan.first_block,
                                          cpu_blocks=plan.cpu_blocks))
            self._swap_counts.reused_blocks += plan.reused_blocks
        return plan

    def _preempt(self, req: Request, rank: int) -> None:
        """Preempt by swap when the policy says so and the CPU has room (only what no valid CPU
        copy holds is copied, FastSwitch §3.3); else by recompute: drop the KV, keep the tokens,
        prefill them again later."""
        v = req.view
        self._free_blocks += v.blocks
        v.preemptions += 1
        self._preemptions += 1
        self._backups.discard(v.id)
        if self._policy.settings.preempt_mode == "swap" and self._cpu is not None and v.computed_tokens:
            plan = self._order_swap_out(v, rank=rank, expected_blocks=blocks_for(
                v.prompt_tokens + v.max_tokens, self._config.block_size))
            if plan is not None:
                v.swapped_blocks = blocks_for(v.computed_tokens, self._config.block_size)
                v.blocks, v.state = 0, "swapped"
                log.debug("preempted", request_id=v.id, mode="swap",
                          copied=len(plan.cpu_blocks), reused=plan.reused_blocks)
                return
        if self._cpu is not None:
            self._cpu.drop(v.id)
        v.blocks, v.computed_tokens, v.state = 0, 0, "waiting"
        log.debug("preempted", request_id=v.id, mode="recompute")

    def _build_step(self, plan: IterationPlan, now: float, rank: dict[int, int]) -> RunStep:
        self._iteration += 1
        setups, seqs, swap_in = [], [], []

        def setup(req: Request) -> None:
            if not req.known_to_executor:
                req.known_to_executor = True
                setups.append(RequestSetup(request_id=req.id, prompt_ids=req.prompt_ids,
                                           sampling=req.sampling, eos_token_ids=req.eos_token_ids))

        for v in plan.swapped_in:
            req = self._live[v.id]
            setup(req)
            sync = v.id in plan.work
            if sync:
                self._swap_counts.sync_swap_ins += 1
            else:
                self._swap_counts.async_swap_ins += 1
            cpu_blocks = self._cpu.blocks(v.id)[:v.swapped_blocks]
            swap_in.append(SwapIn(request_id=v.id, cpu_blocks=tuple(cpu_blocks), sync=sync))
            if self._reusing():  # the copy stays, as a backup: the next swap-out copies less
                self._cpu.mark_backup(v.id, valid_tokens=v.computed_tokens,
                                      rank=rank.get(v.id, len(rank)))
                self._backups.add(v.id)
            else:
                self._cpu.drop(v.id)
            v.swapped_blocks = 0
            if not sync:
                self._free_blocks -= plan.grow[v.id]
                v.blocks, v.state = plan.grow[v.id], "swapping_in"
                req.swap_started = now
        for rid, n in plan.work.items():
            req = self._live[rid]
            v = req.view
            setup(req)
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
                       setups=tuple(setups), seqs=tuple(seqs), swap_out=tuple(self._swap_out),
                       swap_in=tuple(swap_in),
                       granularity=self._policy.settings.memory.swap_granularity)
        self._release, self._swap_out = [], []
        self._step_started = now
        return step

    def _on_step_finished(self, msg: StepFinished) -> None:
        now = anyio.current_time()
        sampled = {s.request_id: s.token_id for s in msg.sampled}
        served, misses = [], 0
        for rid, req in self._in_flight.items():
            v, n = req.view, req.in_flight
            req.in_flight = 0
            req.swap_stall_s += msg.stall_s
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

    def _on_swap_done(self, msg: SwapDone) -> None:
        """Asynchronous swap-ins that finished go back to the running batch."""
        now = anyio.current_time()
        for rid in msg.request_ids:
            req = self._live.get(rid)
            if req is not None and req.view.state == "swapping_in":
                req.view.state = "running"
                req.swap_stall_s += now - req.swap_started
        for rid in msg.failed:
            req = self._live.get(rid)
            if req is None:  # an ended turn whose KV was being kept: which copy is unknown
                self._drop_conversation_copies()
            elif req.view.state in ("swapped", "swapping_in"):
                self._finish(req, "error", f"copying its KV between device and host failed: "
                                           f"{msg.error}")
            # a running request's failed swap-in fails the step that waited for it
        if msg.seconds_per_block is not None:
            old = self._seconds_per_block
            self._seconds_per_block = msg.seconds_per_block if old is None else (
                (1 - SWAP_RATE_SMOOTHING) * old + SWAP_RATE_SMOOTHING * msg.seconds_per_block)

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
            swapped=states.count("swapped"), swapping_in=states.count("swapping_in"),
            free_blocks=self._free_blocks,
            total_blocks=self._total_blocks, live_requests=tuple(self._live),
            preemptions=self._preemptions, iteration_ms=self._last_iteration_ms,
            overload=self._overload, overload_drops=self._overload_fired["drop"],
            overload_restores=self._overload_fired["restore"],
            cpu_free_blocks=self._cpu.num_free if self._cpu else 0,
            cpu_total_blocks=self._cpu.num_total if self._cpu else 0,
            cpu_copies=len(self._cpu.keys()) if self._cpu else 0,
        )
