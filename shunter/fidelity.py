"""Where the simulator's clock and the real one part (issue 18): a torch run that records every
step the engine ran, with the time it took on the device thread and the engine's own time
around it, and what to fit from such records.

Each iteration of a real engine, on one clock (`perf_counter`; the event loop's clock is the
same monotonic clock on Linux):

    planned (scheduler) --pre--> step starts on the device thread --exec--> step ends
        --post--> the next iteration is planned

`exec` is what the step runner does (inputs, forward, sampling); `pre` + `post` is the
engine's own work the simulator's actors do in no virtual time (planning, the allocator, the
hops to and from the device thread, outputs to the frontend, streaming). Both are recorded per
iteration so that the simulator can be charged the engine's measured cost
(`sim.profile.EngineCost`), and the cost model fitted on the step shapes real workloads
produce rather than on a grid.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import anyio
import attrs
import numpy as np

from engine.config import EngineConfig
from engine.cost_model import BatchShape, CostModel
from engine.iteration_log import IterationLog
from engine.messages import ExecuteStep, StepFinished
from engine.metrics import RunMetrics, run_metrics
from gpu.runner import resolve_device
from shunter.backends import build_backend
from shunter.benchmark.driver import Driver, DriveResult
from shunter.benchmark.policies import PolicyChoice
from shunter.calibrate import profile_for
from shunter.contention import CopySpans, fit_contention
from shunter.copier_timing import copy_pickup_ms, fit_swapped_in, stall_wake_ms
from shunter.engine import Engine
from shunter.workloads import Workload
from sim.fit import Fit, fit_recorded_steps
from sim.profile import EngineCost, Profile


@attrs.frozen(kw_only=True)
class StepRecord:
    """One step of a real run, in perf_counter seconds."""

    shape: BatchShape
    seqs: int
    """Sequences the step computed."""
    sampled: int
    """Tokens it sampled (one per sequence that finished its prompt or decoded)."""
    began: float
    ended: float
    stall_s: float
    """Of ended - began, time spent waiting for swap copies (modelled apart by the sim)."""
    request_ids: frozenset[int] = frozenset()
    waited: int = 0
    """Swap tickets the step waited for (its synchronous swap-ins)."""

    @property
    def compute_ms(self) -> float:
        return (self.ended - self.began - self.stall_s) * 1000.0


@attrs.frozen(kw_only=True)
class RecordedRun:
    metrics: RunMetrics
    steps: tuple[StepRecord, ...]
    planned: tuple[float, ...]
    """When each iteration was planned (the iteration log's times)."""
    wall_s: float
    swap: dict[str, Any]
    swap_submits: tuple[float, ...] = ()
    """When each swap transfer was handed to the copier (perf_counter)."""
    copy_s: float = 0.0
    """Seconds the copier's workers spent copying (the copies themselves, not their queueing),
    to set beside the copy model's `calls x dispatch + bytes / bandwidth` for the same traffic."""
    copy_spans: tuple[tuple[float, float], ...] = ()
    """(began, ended) of each of those copies (perf_counter), to tell which steps ran beside
    copies (`shunter.contention`)."""
    scheduler_s: tuple[float, ...] = ()
    """CPU seconds the scheduler spent planning each iteration of `planned` (the iteration
    log's `scheduler_s`): the share of the engine's time that depends on the policy and the
    queue, which a simulator can charge from its own planning (`charge_scheduler_time`)."""

    def planning_s(self, i: int) -> float:
        """The scheduler's CPU seconds for iteration `i` (0 in runs recorded without them)."""
        return self.scheduler_s[i] if i < len(self.scheduler_s) else 0.0

    def swap_iteration_share(self) -> float:
        """Share of iterations during which (from its plan to the next) a swap was issued."""
        if not self.planned:
            return 0.0
        hit = {int(np.searchsorted(self.planned, t, side="right")) - 1 for t in self.swap_submits}
        return len(hit - {-1}) / len(self.planned)


def _record_steps(runner: Any, into: list[StepRecord]) -> None:
    """Wrap `runner.execute` (called on its device thread) to append a StepRecord per step."""
    execute = runner.execute

    def recorded(step: ExecuteStep) -> StepFinished:
        began = time.perf_counter()
        done = execute(step)
        ended = time.perf_counter()
        if step.seqs:
            shape = BatchShape.of((w.start, w.num_tokens) for w in step.seqs)
            into.append(StepRecord(shape=shape, seqs=len(step.seqs), sampled=len(done.sampled),
                                   began=began, ended=ended, stall_s=done.stall_s,
                                   request_ids=frozenset(w.request_id for w in step.seqs),
                                   waited=len(step.wait_tickets)))
        return done

    runner.execute = recorded


def recorded_run(choice: PolicyChoice, workload: Workload, base: EngineConfig) -> RecordedRun:
    """Serve `workload` with the policy on the torch engine `base` names, recording every step."""
    config = attrs.evolve(base, record_iterations=True, policy=choice.path, **choice.overrides)
    backend = build_backend(config)
    steps: list[StepRecord] = []
    submits: list[float] = []
    copy_time: list[tuple[float, float]] = []
    _record_steps(backend.runner, steps)

    async def serve() -> tuple[DriveResult, IterationLog | None]:
        async with Engine.start(config, backend=backend) as engine:
            if engine.swapper is not None:
                _record_submits(engine.swapper, submits, copy_time)
            driver = Driver(engine, workload, vocab=backend.vocab_size,
                            declared_classes={c.name for c in engine.policy.settings.classes})
            result = await driver.run()
            return result, await engine.take_iteration_log()

    began = time.perf_counter()
    drive, log = anyio.run(serve)
    wall = time.perf_counter() - began
    metrics = run_metrics(drive.timelines, duration_s=drive.finished - drive.started,
                          goals=drive.goals, failed=drive.failed, log=log)
    return RecordedRun(metrics=metrics, steps=tuple(steps),
                       planned=tuple(log.time) if log is not None else (), wall_s=wall,
                       swap=attrs.asdict(log.swap) if log is not None else {},
                       swap_submits=tuple(submits), copy_s=sum(e - b for b, e in copy_time),
                       copy_spans=tuple(sorted(copy_time)),
                       scheduler_s=tuple(log.scheduler_s) if log is not None else ())


def _record_submits(swapper: Any, into: list[float], copy_time: list[tuple[float, float]]) -> None:
    """Wrap the copier's `submit` (when each transfer is issued) and, where it has one, the
    copy its workers run (`gpu.swap.TorchSwapper._copy`: how long the copies take)."""
    submit = swapper.submit
    copy = getattr(swapper, "_copy", None)
    if copy is not None:
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return copy(*args, **kwargs)
            finally:
                copy_time.append((began, time.perf_counter()))  # list.append: thread-safe

        swapper._copy = timed

    def recorded(*args: Any, **kwargs: Any) -> Any:
        into.append(time.perf_counter())
        return submit(*args, **kwargs)

    swapper.submit = recorded


def fit_rows(runs: Sequence[RecordedRun], *,
             skip_copying: bool = False) -> list[tuple[BatchShape, float]]:
    """(shape, compute ms) of every step of `runs`: the rows to fit the cost model on;
    with `skip_copying`, not the steps that had swap copies running beside them."""
    out = []
    for r in runs:
        spans = CopySpans(r.copy_spans if skip_copying else ())
        out += [(s.shape, s.compute_ms) for s in r.steps
                if s.compute_ms > 0 and not spans.ms(s.began + s.stall_s, s.ended)]
    return out


def _back_to_back(run: RecordedRun) -> list[tuple[StepRecord, StepRecord, float, float]]:
    """(step, next step, when the next was planned, the scheduler's CPU seconds planning it)
    for every step whose next one computes a request of it: that request was ready the moment
    the step ended, so the engine did not idle between the two (a gap before a step of new
    requests only may be time waiting for them to arrive)."""
    out = []
    planned = np.array(run.planned)
    for cur, nxt in zip(run.steps, run.steps[1:]):
        if not cur.request_ids & nxt.request_ids:
            continue
        # the plan of the next step: the latest planning time before it started
        i = int(np.searchsorted(planned, nxt.began)) - 1
        if i < 0 or planned[i] < cur.began:
            continue
        out.append((cur, nxt, float(planned[i]), run.planning_s(i)))
    return out


def engine_gaps(run: RecordedRun, *, skip_copying: bool = False,
                net_of_scheduler: bool = False) -> list[tuple[StepRecord, float, float]]:
    """(step, ms of engine work between its end and the next step's start, of which ms after
    the next step was planned) for every back-to-back pair of steps (`_back_to_back`); with
    `skip_copying`, not the gaps that had swap copies running beside them; with
    `net_of_scheduler`, less the scheduler's CPU time planning the next step (from both)."""
    spans = CopySpans(run.copy_spans if skip_copying else ())
    out = []
    for cur, nxt, plan, sched in _back_to_back(run):
        if spans.ms(cur.ended, nxt.began):
            continue
        less = sched * 1000.0 if net_of_scheduler else 0.0
        out.append((cur, (nxt.began - cur.ended) * 1000.0 - less, (nxt.began - plan) * 1000.0 - less))
    return out


def fit_engine_cost(runs: Sequence[RecordedRun], source: str, *, skip_copying: bool = False,
                    net_of_scheduler: bool = False) -> EngineCost:
    """Least squares of the gap between back-to-back steps on (1, sequences, sampled tokens):
    the engine's own cost per iteration and per sequence, kept >= 0 (with `skip_copying`, on
    the gaps without swap copies beside them). With `net_of_scheduler`, on the gaps less the
    scheduler's own planning time, which the simulator then charges from its own planning
    (`EngineCost.planning_scale`): planning is what differs most between policies (a policy
    that reranks and plans swaps every iteration plans 3-4x longer than FCFS), and the same
    planning code runs in the simulator, so its cost follows the policy there too."""
    if net_of_scheduler and not all(r.scheduler_s for r in runs):
        raise ValueError("net_of_scheduler needs runs recorded with the scheduler's times")
    gaps_of = [engine_gaps(r, skip_copying=skip_copying, net_of_scheduler=net_of_scheduler)
               for r in runs]
    pairs = [(s, g) for gs in gaps_of for s, g, _ in gs]
    pre = sum(p for gs in gaps_of for _, _, p in gs)
    if len(pairs) < 8:
        raise ValueError(f"only {len(pairs)} back-to-back steps to fit the engine's cost on")
    gaps = np.array([g for _, g in pairs])
    keep = gaps <= np.quantile(gaps, 0.98)  # a step next to another process's burst
    x = np.array([[1.0, s.seqs, s.sampled] for s, _ in pairs])[keep]
    y = gaps[keep]
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    if coef[1] < 0 or coef[2] < 0:  # refit on what stays non-negative
        col = 1 if coef[2] < 0 else 2
        sub, *_ = np.linalg.lstsq(x[:, [0, col]], y, rcond=None)
        coef = np.zeros(3)
        coef[[0, col]] = np.maximum(sub, 0.0)
    pred = x @ coef
    return EngineCost(per_iteration_ms=float(max(coef[0], 0.0)), per_seq_ms=float(coef[1]),
                      per_sampled_ms=float(coef[2]), before_share=float(pre / gaps.sum()),
                      planning_scale=1.0 if net_of_scheduler else None,
                      source=f"{source}; {int(keep.sum())} back-to-back steps, median gap "
                             f"{float(np.median(y)):.3f} ms, median error "
                             f"{float(np.median(np.abs(pred - y))):.3f} ms")


def profile_from_runs(config: EngineConfig, runs: Sequence[RecordedRun], *, name: str,
                      kv_cache_mib: float, gb_per_s: float, dispatch_us: float,
                      source: str, net_of_scheduler: bool = False) -> tuple[Profile, Fit]:
    """A sim profile of `config.model` on this machine fitted on recorded runs: the cost model
    on their steps, the engine's own cost on the gaps between them, the given copy link (its
    per-call cost raised to what the runs' own copies took, when they swapped: see
    `copy_dispatch_us`). On the CPU, where the copies share the cores with the engine, the two
    models are fitted on the steps and gaps with no copy beside them, and what copying adds to
    the others is fitted apart (`shunter.contention`); a GPU's copy engine runs beside compute,
    so its profile charges none. With `net_of_scheduler` the engine's cost leaves out the
    scheduler's planning (`fit_engine_cost`): the sim must charge its own."""
    contended = resolve_device(config.device).type == "cpu" and any(r.copy_spans for r in runs)
    rows = fit_rows(runs, skip_copying=contended)
    fit = fit_recorded_steps(rows, source=f"{len(rows)} recorded steps of {source}")
    cost = fit_engine_cost(runs, source=f"gaps between the recorded steps of {source}",
                           skip_copying=contended, net_of_scheduler=net_of_scheduler)
    if any(r.copy_spans for r in runs):
        cost = attrs.evolve(cost, copy_start_ms=copy_start_ms(runs, net_of_scheduler=net_of_scheduler),
                            copy_pickup_ms=copy_pickup_ms(runs), wake_ms=stall_wake_ms(runs))
        cost = fit_swap_dispatch(runs, cost)
    profile = profile_for(config, name=name, fit=fit, kv_cache_mib=kv_cache_mib,
                          gb_per_s=gb_per_s, dispatch_us=copy_dispatch_us(runs, gb_per_s, dispatch_us))
    contention = None
    if contended:
        contention = fit_contention(*contention_rows(runs, fit.cost, cost),
                                    source=f"copies of {source} beside steps and gaps")
        contention = attrs.evolve(contention, swapped_in_ms=fit_swapped_in(runs, fit.cost))
    return attrs.evolve(profile, engine_cost=cost, copy_contention=contention), fit


def copy_start_ms(runs: Sequence[RecordedRun], *, net_of_scheduler: bool = False) -> float:
    """Median ms from a plan to the moment the first swap it issued was handed to the copier
    (the swap pool's hop), over the runs that copied; with `net_of_scheduler`, from the end of
    the planning (the simulator charging its own planning submits the swaps after it). The sim
    hands an iteration's transfers over at once; what happens after, the copier's wake-up
    (`shunter.copier_timing.copy_pickup_ms`, measured from that first hand-over) and its queue
    (the sim's copy engine), is modelled apart."""
    lags = []
    for r in runs:
        if not r.copy_spans:
            continue
        planned, first = np.array(r.planned), set()
        for t in sorted(r.swap_submits):
            i = int(np.searchsorted(planned, t, side="right")) - 1
            if i >= 0 and i not in first:
                first.add(i)
                lags.append((t - planned[i] - (r.planning_s(i) if net_of_scheduler else 0.0)) * 1000.0)
    return float(np.median(lags)) if lags else 0.0


def pre_step(run: RecordedRun, *, net_of_scheduler: bool) -> list[tuple[StepRecord, float, int]]:
    """(step, ms from its plan to its start, transfers issued in that time) for each step with
    a plan before it; with `net_of_scheduler`, from the end of the planning."""
    planned, submits = np.array(run.planned), np.array(run.swap_submits)
    out = []
    for s in run.steps:
        i = int(np.searchsorted(planned, s.began)) - 1
        if i < 0:
            continue
        issued = int(np.count_nonzero((submits >= planned[i]) & (submits < s.began)))
        less = run.planning_s(i) if net_of_scheduler else 0.0
        out.append((s, (s.began - planned[i] - less) * 1000.0, issued))
    return out


def fit_swap_dispatch(runs: Sequence[RecordedRun], engine: EngineCost) -> EngineCost:
    """`engine` with `swap_dispatch_ms` and `per_transfer_ms`: least squares, >= 0, of each
    step's time from its plan to its start above the engine cost's share before the step, on
    (the iteration issued swaps, transfers it issued), over the runs that swapped. The detour
    through the swap pool is measured here, not in the engine cost's gaps: those left out the
    gaps with copies beside them, and every swapping iteration has its copies there."""
    net = engine.planning_scale is not None
    rows = [(issued, ms - engine.ms(s.seqs, s.sampled) * engine.before_share)
            for r in runs if r.swap_submits for s, ms, issued in pre_step(r, net_of_scheduler=net)]
    if not any(issued for issued, _ in rows):
        return engine
    arr = np.array(rows, dtype=np.float64)
    arr = arr[arr[:, 1] <= np.quantile(arr[:, 1], 0.98)]  # a step next to another's burst
    x = np.c_[arr[:, 0] > 0, arr[:, 0]].astype(np.float64)
    coef, *_ = np.linalg.lstsq(x, arr[:, 1], rcond=None)
    if coef.min() < 0:  # refit on the column that stays non-negative
        col = int(np.argmax(coef))
        sub, *_ = np.linalg.lstsq(x[:, [col]], arr[:, 1], rcond=None)
        coef = np.zeros(2)
        coef[col] = max(float(sub[0]), 0.0)
    return attrs.evolve(engine, swap_dispatch_ms=float(coef[0]), per_transfer_ms=float(coef[1]))


def planning_scale(runs: Sequence[RecordedRun], sim_planning_s: float) -> float:
    """How much longer the real engine planned than the simulator: the scheduler's CPU seconds
    over all iterations of `runs` against `sim_planning_s`, the same over sim runs of the same
    workloads and policies (`EngineCost.planning_scale`). Measured, not assumed: on the CPU
    backend the real planner shares the caches with the model's steps."""
    real = sum(sum(r.scheduler_s) for r in runs)
    if real <= 0 or sim_planning_s <= 0:
        raise ValueError("planning_scale needs the scheduler's times of both engines")
    return real / sim_planning_s


def contention_rows(runs: Sequence[RecordedRun], cost: CostModel, engine: EngineCost) -> tuple[
        list[tuple[float, float, float]], list[tuple[float, float, float]]]:
    """(measured ms, predicted ms, ms of copying beside it) of every step and of every gap
    between back-to-back steps of `runs`: what `shunter.contention.fit_contention` fits on
    (the gaps net of the scheduler's planning when `engine` is)."""
    steps, gaps = [], []
    for r in runs:
        spans = CopySpans(r.copy_spans)
        steps += [(s.compute_ms, cost.predict_ms(s.shape), spans.ms(s.began + s.stall_s, s.ended))
                  for s in r.steps if s.compute_ms > 0]
        net = engine.planning_scale is not None
        issued = {id(s): n for s, _, n in pre_step(r, net_of_scheduler=net)}
        gaps += [((nxt.began - cur.ended - (sched if net else 0.0)) * 1000.0,
                  engine.ms(cur.seqs, cur.sampled) + engine.swap_ms(issued.get(id(nxt), 0)),
                  spans.ms(cur.ended, nxt.began)) for cur, nxt, _, sched in _back_to_back(r)]
    return steps, gaps


def copy_dispatch_us(runs: Sequence[RecordedRun], gb_per_s: float, dispatch_us: float) -> float:
    """The per-call copy cost that makes `calls x dispatch + bytes / bandwidth` equal the time
    the recorded runs' copier spent copying (the swapper's calls cost more than the bare copy
    loop `measure_copy` times: slicing, bounded dispatch, sharing the cores with the steps);
    the measured `dispatch_us` when that is more, or when the runs did not swap."""
    calls = sum(r.swap.get("copy_ops", 0) for r in runs)
    nbytes = sum(r.swap.get("bytes_in", 0) + r.swap.get("bytes_out", 0) for r in runs)
    seconds = sum(r.copy_s for r in runs)
    if not calls or seconds <= 0:
        return dispatch_us
    return max(dispatch_us, (seconds - nbytes / (gb_per_s * 1e9)) / calls * 1e6)
