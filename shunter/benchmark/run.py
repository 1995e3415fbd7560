"""Run one workload against each policy in turn: same workload, same seed, same arrivals; a
fresh engine per run. The sim backend runs under trio with a `MockClock(autojump_threshold=0)`,
so the engine's clock is virtual and a step costs only the scheduler's own work; the torch
backend runs in real time."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import attrs
import trio.testing

from engine.config import EngineConfig
from engine.errors import ShunterError
from engine.iteration_log import IterationLog
from engine.metrics import RunMetrics, run_metrics
from shunter.benchmark.driver import Driver, DriveResult, expected_requests
from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.progress import Progress
from shunter.commands.cluster_options import start_engine
from shunter.workloads import Workload


@attrs.frozen(kw_only=True)
class RunOutcome:
    label: str
    config: EngineConfig | None
    """The engine the run started; None for a run against a server (`server` says which)."""
    wall_s: float
    metrics: RunMetrics | None = None
    drive: DriveResult | None = None
    log: IterationLog | None = None
    error: str | None = None
    """Why the run could not happen (e.g. the policy needs a mechanism this engine lacks)."""
    server: dict[str, Any] | None = None
    """`--backend http`: the server's URL, model and the policy file sent to it."""


async def _serve(config: EngineConfig, choice: PolicyChoice, workload: Workload,
                 progress: bool, limit_s: float | None = None,
                 cluster: Any = None) -> tuple[DriveResult, IterationLog | None]:
    with anyio.fail_after(limit_s):
        return await _serve_all(config, choice, workload, progress, cluster)


async def _serve_all(config: EngineConfig, choice: PolicyChoice, workload: Workload,
                     progress: bool, cluster: Any = None) -> tuple[DriveResult, IterationLog | None]:
    # `cluster`: the command's --instances/--cluster (None: one engine in this process)
    async with start_engine(config, cluster) as engine:  # config.policy: the choice's file
        policy = engine.policy
        bar = Progress(choice.label, expected_requests(workload),
                       clock=anyio.current_time) if progress else None
        driver = Driver(engine, workload, vocab=engine.backend.vocab_size,
                        declared_classes={c.name for c in policy.settings.classes},
                        on_progress=bar.update if bar else None)
        result = await driver.run()
        if bar:
            bar.close()
        groups = getattr(engine, "groups", None)  # KunServe on a simulated cluster
        if groups is not None:
            result.cluster = groups.report(result.started)
        take_log = getattr(engine, "take_iteration_log", None)  # a cluster keeps none
        log = await take_log() if take_log is not None else None
    return result, log


@contextlib.contextmanager
def replay_task_order_exactly() -> Iterator[None]:
    """Trio orders the tasks that are ready at the same instant at random, on purpose: two sim
    runs of one workload then differed by up to 8% in a policy's throughput. A simulator run must
    replay exactly, so each starts trio's tie-breaking generator from the same seed, and with the
    same algorithm: trio reverses each batch of ready tasks with probability 1/2, but once
    pytest-trio is loaded or hypothesis imported (`_ALLOW_DETERMINISTIC_SCHEDULING`) it sorts the
    batch by task and shuffles it; the two draw different orders from one seed, so the same
    arrivals gave fcfs 1.114 BE req/s from a script and 1.103 under pytest. Sim runs use the
    first (a script's; the one bench/results were recorded under) wherever they run, and the flag
    is put back after. Both are private to trio (`trio._core._run`); if trio moves them, runs
    are merely not reproducible."""
    run = getattr(getattr(trio, "_core", None), "_run", None)
    rng = getattr(run, "_r", None)
    if rng is not None:
        rng.seed(0)
    flag = "_ALLOW_DETERMINISTIC_SCHEDULING"
    had = getattr(run, flag, None)
    if had is None:
        yield
        return
    setattr(run, flag, False)
    try:
        yield
    finally:
        setattr(run, flag, had)


def run_one(choice: PolicyChoice, workload: Workload, base: EngineConfig, *,
            async_backend: str = "asyncio", progress: bool = True,
            clock_limit_s: float | None = None, cluster: Any = None) -> RunOutcome:
    """One policy's run; `clock_limit_s` ends it (as an error) after that long on the engine's
    clock, virtual on the sim: a thrashing policy may otherwise run for simulated hours."""
    config = attrs.evolve(base, record_iterations=True, policy=choice.path, **choice.overrides)
    began = time.perf_counter()
    try:
        if config.backend == "sim":
            clock = trio.testing.MockClock(autojump_threshold=0)
            with replay_task_order_exactly():
                drive, log = anyio.run(_serve, config, choice, workload, progress, clock_limit_s,
                                       cluster, backend="trio", backend_options={"clock": clock})
        else:
            drive, log = anyio.run(_serve, config, choice, workload, progress, clock_limit_s,
                                   cluster, backend=async_backend)
    except TimeoutError:
        return RunOutcome(label=choice.label, config=config, wall_s=time.perf_counter() - began,
                          error=f"did not finish within {clock_limit_s} s of engine clock")
    except ShunterError as exc:
        return RunOutcome(label=choice.label, config=config, wall_s=time.perf_counter() - began,
                          error=f"{type(exc).__name__}: {exc}")
    wall = time.perf_counter() - began
    metrics = run_metrics(drive.timelines, duration_s=drive.finished - drive.started,
                          goals=drive.goals, failed=drive.failed, log=log)
    return RunOutcome(label=choice.label, config=config, wall_s=wall, metrics=metrics,
                      drive=drive, log=log)


def run_all(choices: Sequence[PolicyChoice], workload: Workload, base: EngineConfig, *,
            async_backend: str = "asyncio", progress: bool = True,
            cluster: Any = None) -> list[RunOutcome]:
    return [run_one(c, workload, base, async_backend=async_backend, progress=progress,
                    cluster=cluster)
            for c in choices]


def report_json(workload: Workload, base: EngineConfig, outcomes: Sequence[RunOutcome]) -> dict[str, Any]:
    """The bench JSON (issue 4's shape, plus configuration, wall time and time series)."""
    out: dict[str, Any] = {"workload": workload.describe(), "backend": base.backend,
                           "runs": runs_json(outcomes)}
    if base.backend == "sim":
        out["profile"] = base.profile
    else:
        out["model"] = str(base.model)
    return out


def runs_json(outcomes: Sequence[RunOutcome]) -> list[dict[str, Any]]:
    runs = []
    for o in outcomes:
        engine = _config_dict(o.config) if o.config is not None else o.server
        run: dict[str, Any] = {"policy": o.label, "wall_s": o.wall_s, "engine": engine}
        if o.error is not None:
            run["error"] = o.error
        else:
            run["metrics"] = o.metrics.as_dict()
            run["errors"] = o.drive.errors
            if o.log is not None:
                run["timeseries"] = timeseries(o.log, o.drive.started)
            if o.drive.cluster is not None:
                run["cluster"] = o.drive.cluster
        runs.append(run)
    return runs


def _config_dict(c: EngineConfig) -> dict[str, Any]:
    keys = ("num_blocks", "block_size", "max_num_seqs", "max_batched_tokens",
            "max_queued_requests", "cpu_swap_blocks")
    out = {k: getattr(c, k, None) for k in keys}
    out["policy_file"] = str(c.policy) if c.policy else None
    return out


def timeseries(log: IterationLog, t0: float, points: int = 400) -> dict[str, list[float]]:
    """The per-iteration log thinned to about `points` samples (for plots from the JSON)."""
    n = len(log)
    step = max(1, n // points)
    idx = range(0, n, step)
    usage = log.kv_usage()
    return {"t_s": [log.time[i] - t0 for i in idx], "kv_usage": [usage[i] for i in idx],
            "queued": [log.queued[i] for i in idx], "batch_seqs": [log.batch_seqs[i] for i in idx]}
