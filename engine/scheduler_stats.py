"""What the scheduler counts and reports: preemptions, overload triggers, the per-iteration log
and the snapshot it answers `InspectScheduler` with. No decisions, no I/O but logging."""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from engine.cost_model import CostModel
from engine.iteration_log import IterationLog
from engine.memory.device_prefixes import DevicePrefixes
from engine.memory.host_copies import HostCopies
from engine.memory.swap_in_profiler import SwapInProfiler
from engine.policy import OverloadSignal
from engine.prediction import IterationPredictor
from engine.request import Request
from engine.snapshots import SchedulerSnapshot

log = structlog.get_logger(actor="scheduler")


class SchedulerStats:
    def __init__(self, *, total_blocks: int, record_iterations: bool, block_size: int = 16,
                 cost: CostModel | None = None, correction_window: int = 0) -> None:
        self.total_blocks = total_blocks
        self.predictor = IterationPredictor(cost, correction_window=correction_window)
        """Iteration-time predictions for the policy (BROS §4.1) and their errors."""
        self.last_scheduler_s = 0.0
        """CPU seconds the scheduler spent planning the last iteration."""
        self.prefixes = DevicePrefixes(block_size, total_blocks)
        """The device prefix cache's bookkeeping (the scheduler drives it; counted here)."""
        self.preemptions = 0
        """Preemptions since the engine started (by swap and by recompute)."""
        self.cancelled_by_state: dict[str, int] = {}
        """Cancellations since the engine started, by the state the request was in."""
        self.overload: OverloadSignal | None = None
        """The overload trigger firing now (KunServe §4.1, §4.4)."""
        self.overload_fired = {"drop": 0, "restore": 0}
        """How often each trigger started firing."""
        self._log = IterationLog(total_blocks=total_blocks) if record_iterations else None

    def note_cancel(self, state: str) -> None:
        self.cancelled_by_state[state] = self.cancelled_by_state.get(state, 0) + 1

    @property
    def recording(self) -> bool:
        """Iterations are logged (`EngineConfig.record_iterations`)."""
        return self._log is not None

    def note_overload(self, signal: OverloadSignal | None, *, iteration: int,
                      free_blocks: int) -> None:
        """Until the cluster coordinator acts on them, overload triggers are counted and logged
        when they start and stop firing."""
        if signal == self.overload:
            return
        if self.overload is not None:
            log.info("overload trigger stopped firing", trigger=self.overload, iteration=iteration)
        if signal is not None:
            self.overload_fired[signal] += 1
            log.info("overload trigger fired", trigger=signal, iteration=iteration,
                     free_blocks=free_blocks, total_blocks=self.total_blocks)
        self.overload = signal

    @property
    def cost_model(self) -> CostModel | None:
        return self.predictor.model

    def step_done(self, measured_ms: float) -> float:
        """The iteration just ended took `measured_ms`; returns it."""
        pair = self.predictor.finished(measured_ms)
        if pair is not None and self._log is not None:
            self._log.predictions.append(pair)
            self._log.raw_predictions.append(self.predictor.last_raw_ms or 0.0)
        return measured_ms

    def record_iteration(self, *, now: float, scheduler_s: float, batch_seqs: int,
                         batch_tokens: int, queued: int, used_blocks: int, seqs=()) -> None:
        self.last_scheduler_s = scheduler_s
        self.predictor.started(seqs)
        if self._log is not None:
            self._log.add(now=now, scheduler_s=scheduler_s, batch_seqs=batch_seqs,
                          batch_tokens=batch_tokens, queued=queued, used_blocks=used_blocks)

    def take_log(self, profiler: SwapInProfiler, copies: HostCopies | None) -> IterationLog | None:
        """The log since the last take, with the swap events the scheduler's mechanisms counted
        (reuse, turn-end copies, sync/async swap-ins), or None when not recording."""
        swap = profiler.take_counters()
        if copies is not None:
            swap = swap.plus(copies.take_counters())
        taken = self._log
        if taken is not None:
            taken.preemptions = self.preemptions
            taken.swap = swap
            taken.prefix = self.prefixes.take_counters()
            self._log = IterationLog(total_blocks=self.total_blocks)
        return taken

    def snapshot(self, *, iteration: int, policy: str, policy_version: int,
                 requests: Iterable[Request],
                 free_blocks: int, iteration_ms: float,
                 copies: HostCopies | None) -> SchedulerSnapshot:
        live = list(requests)
        states = [r.state for r in live]
        return SchedulerSnapshot(
            iteration=iteration, policy=policy, policy_version=policy_version,
            waiting=states.count("waiting"), running=states.count("running"),
            swapped=states.count("swapped"), swapping_in=states.count("swapping_in"),
            free_blocks=free_blocks, total_blocks=self.total_blocks,
            live_requests=tuple(r.id for r in live), preemptions=self.preemptions,
            iteration_ms=iteration_ms, overload=self.overload,
            overload_drops=self.overload_fired["drop"],
            overload_restores=self.overload_fired["restore"],
            cpu_free_blocks=copies.num_free if copies else 0,
            cpu_total_blocks=copies.num_total if copies else 0,
            cpu_copies=copies.num_copies if copies else 0,
            cpu_kept_blocks=copies.kept_blocks if copies else 0,
            prefix_cache=self.prefixes.snapshot(),
            cost_correction=self.predictor.correction_factors(),
            cancelled_by_state=tuple(sorted(self.cancelled_by_state.items())),
            queued_tokens=sum(r.context_tokens for r in live if r.state in ("waiting", "swapped")),
            head_tokens=min(((r.arrival, r.context_tokens) for r in live
                             if r.state in ("waiting", "swapped")), default=(0.0, 0))[1],
            pending_tokens=sum(max(0, r.prompt_tokens - r.computed_tokens - r.in_flight_tokens)
                               for r in live if r.state == "running"),
        )
