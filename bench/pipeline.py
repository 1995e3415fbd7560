"""One instance vs a pipeline vs data-parallel instances, and what the coordinator costs.

    python bench/pipeline.py torch [--requests 32] [--max-tokens 64] [--rounds 2]
    python bench/pipeline.py sim [--instances 4] [--rate 8] [--requests 400]
    python bench/pipeline.py coordinator [--rate 1000] [--seconds 5]

torch: the same model (the shipped one unless --model) served three ways on this machine, each
started once and measured in interleaved rounds: one engine in this process (--single-threads,
default 1),
a 2-stage pipeline (two stage processes over gloo, one thread each), and two data-parallel
instances behind the coordinator (one thread each). Reports output tokens/s and TPOT p50, and
for the pipeline the overhead per stage boundary (step wall time minus the GPipe makespan of
the stages' measured compute, per microbatch and boundary: the control round trip, the
activation send and receive) and the bubble ratio (1 - compute / (stages x wall)).

sim: the Llama-3-8B A100 profile on the virtual clock: one instance, a K-stage pipeline and K
data-parallel instances (K = --instances GPUs), Poisson arrivals; throughput, TPOT, the
pipeline's bubble ratio and activation transfer time over the a100-internode link.

coordinator: a cluster of --instances simulated instances at --rate requests/s; wall time of
the dispatch decision (the ChooseInstance round trip) and of the monitor's stats round trips,
per request and per second, against the profile's step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import shunter  # noqa: E402
from engine.cluster.plan import pipeline_timing  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.metrics import summarize  # noqa: E402
from shunter.benchmark.run import replay_task_order_exactly  # noqa: E402
from shunter.cluster.cluster import Cluster  # noqa: E402


async def _workload(target, prompts, max_tokens: int, rate: float | None = None):
    """Serve `prompts` (all at once, or Poisson at `rate`); returns (wall/virtual s, timelines)."""
    import random

    rng = random.Random(0)
    timelines = []

    async def one(prompt, delay: float) -> None:
        await anyio.sleep(delay)
        async for chunk in target.generate(prompt, shunter.SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True)):
            if chunk.finish_reason:
                timelines.append(chunk.timeline)

    began = anyio.current_time()
    async with anyio.create_task_group() as tg:
        t = 0.0
        for p in prompts:
            tg.start_soon(one, p, t)
            if rate:
                t += rng.expovariate(rate)
    return anyio.current_time() - began, timelines


def _row(elapsed: float, timelines) -> dict:
    s = summarize(timelines, duration_s=elapsed)
    return {"tokens_per_s": s.output_tokens / elapsed, "tpot_p50_ms": s.tpot_ms.p50,
            "ttft_p50_ms": s.ttft_ms.p50, "elapsed_s": elapsed}


def _pipeline_overheads(records) -> dict:
    per_boundary, bubbles = [], []
    for r in records:
        stages, micro = len(r.compute_s), len(r.compute_s[0])
        if not micro:
            continue  # a step with no sequences (only releases)
        ideal = pipeline_timing(r.compute_s, [0.0] * micro).makespan
        per_boundary.append((r.wall_s - ideal) / (micro * (stages - 1)))
        bubbles.append(1 - sum(map(sum, r.compute_s)) / (stages * r.wall_s))
    return {"boundary_overhead_ms_per_microbatch": 1e3 * statistics.median(per_boundary),
            "bubble_ratio": statistics.median(bubbles), "steps": len(records)}


async def bench_torch(args) -> dict:
    import os
    from contextlib import AsyncExitStack

    model = args.model or EngineConfig().model
    base = dict(model=model, device="cpu", cpu_swap_blocks=0, num_blocks=256,
                max_num_seqs=args.requests)
    prompts = [[(13 * i + j) % 200 + 5 for j in range(8 + i % 24)] for i in range(args.requests)]
    rows: dict[str, list[dict]] = {"one instance": [], "2-stage pipeline": [],
                                   "2 data-parallel instances": []}
    async with AsyncExitStack() as stack:
        single = await stack.enter_async_context(shunter.Engine.start(EngineConfig(
            **base, threads=args.single_threads or os.cpu_count())))
        piped = await stack.enter_async_context(shunter.Engine.start(EngineConfig(
            **base, threads=1, pipeline_stages=2, pipeline_microbatches=args.microbatches)))
        dp = await stack.enter_async_context(Cluster.start(EngineConfig(**base, threads=1),
                                                           instances=2))
        runner = piped.backend.runner
        for _ in range(args.rounds):
            for name, target in (("one instance", single), ("2-stage pipeline", piped),
                                 ("2 data-parallel instances", dp)):
                if name == "2-stage pipeline":
                    runner.records = []
                rows[name].append(_row(*await _workload(target, prompts, args.max_tokens)))
        overheads = _pipeline_overheads(runner.records)
    out = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for name, rs in rows.items()}
    out["2-stage pipeline"] |= overheads
    return {"backend": "torch", "model": str(model), "requests": args.requests,
            "max_tokens": args.max_tokens, "rounds": args.rounds,
            "single_threads": args.single_threads or os.cpu_count(),
            "microbatches": args.microbatches, "results": out}


def bench_sim(args) -> dict:
    import trio
    import trio.testing

    k = args.instances
    prompts = [list(range(1, 1 + 64 + (i * 37) % 448)) for i in range(args.requests)]
    setups = {"one instance (1 GPU)": (1, 1), f"{k}-stage pipeline ({k} GPUs)": (1, k),
              f"{k} data-parallel instances ({k} GPUs)": (k, 1)}
    out = {}
    for name, (instances, stages) in setups.items():
        async def run():
            config = EngineConfig(backend="sim", cpu_swap_blocks=0, pipeline_stages=stages,
                                  pipeline_microbatches=args.microbatches)
            async with Cluster.start(config, instances=instances, kind="inprocess") as cl:
                row = _row(*await _workload(cl, prompts, args.max_tokens, rate=args.rate))
                runner = cl.instances[0].engine.backend.runner
                totals = getattr(runner, "totals", None)
                if totals is not None:
                    row |= {"bubble_ratio": totals.bubble_ratio,
                            "activation_transfer_ms_per_step":
                                1e3 * totals.transfer_s / max(1, totals.steps),
                            "microbatches_per_step": totals.microbatches / max(1, totals.steps)}
                return row

        began = time.perf_counter()
        with replay_task_order_exactly():  # the same order in a script and under pytest
            out[name] = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
        out[name]["wall_s"] = time.perf_counter() - began
    return {"backend": "sim", "profile": "llama3-8b-a100", "link": "a100-internode",
            "rate": args.rate, "requests": args.requests, "max_tokens": args.max_tokens,
            "microbatches": args.microbatches, "results": out}


def bench_coordinator(args) -> dict:
    import trio
    import trio.testing

    from actors.coordinator import Coordinator
    from engine.cluster.messages import ChooseInstance

    n = int(args.rate * args.seconds)
    choose_s: list[float] = []
    stats_s: list[float] = []
    decide_s: list[float] = []
    handle = Coordinator.handle

    def timed_handle(self, msg):  # the coordinator's own work per message
        began = time.perf_counter()
        handle(self, msg)
        if isinstance(msg, ChooseInstance):
            decide_s.append(time.perf_counter() - began)

    Coordinator.handle = timed_handle

    async def run():
        config = EngineConfig(backend="sim", cpu_swap_blocks=0)
        async with Cluster.start(config, instances=args.instances, kind="inprocess") as cl:
            choose = cl._choose

            async def timed_choose(demand: int) -> int:
                began = time.perf_counter()
                try:
                    return await choose(demand)
                finally:
                    choose_s.append(time.perf_counter() - began)

            cl._choose = timed_choose
            for inst in cl.instances:
                stats = inst.stats

                async def timed_stats(stats=stats):
                    began = time.perf_counter()
                    try:
                        return await stats()
                    finally:
                        stats_s.append(time.perf_counter() - began)

                inst.stats = timed_stats
            prompts = [list(range(1, 129))] * n
            elapsed, timelines = await _workload(cl, prompts, 32, rate=args.rate)
            steps = sum(inst.engine.backend.runner.steps for inst in cl.instances)
            busy = sum(inst.engine.backend.runner.busy_s for inst in cl.instances)
            return elapsed, len(timelines), busy / max(1, steps)

    began = time.perf_counter()
    elapsed, done, step_s = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    wall = time.perf_counter() - began
    dispatch_us = 1e6 * statistics.mean(choose_s)
    return {"backend": "sim", "instances": args.instances, "rate": args.rate, "requests": n,
            "completed": done, "virtual_s": elapsed, "wall_s": wall,
            "dispatch_decision_us_mean": 1e6 * statistics.mean(decide_s),
            "dispatch_round_trip_us_mean": dispatch_us,
            "dispatch_round_trip_us_p99": 1e6 * sorted(choose_s)[int(0.99 * len(choose_s))],
            "stats_round_trip_us_mean": 1e6 * statistics.mean(stats_s),
            "stats_round_trips_per_virtual_s": len(stats_s) / elapsed,
            "coordinator_wall_ms_per_virtual_s": 1e3 * (sum(choose_s) + sum(stats_s)) / elapsed,
            "mean_step_ms": 1e3 * step_s,
            "dispatch_round_trip_share_of_a_step": dispatch_us / 1e3 / (1e3 * step_s),
            "note": "round trips are wall time of an await in a busy event loop, so they include "
                    "other tasks that ran meanwhile; the decision is the coordinator's own work"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("torch", "sim", "coordinator"))
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--single-threads", type=int, default=1,
                   help="torch threads of the one-instance engine (0: one per core; with other "
                        "work on the machine, more than one collapses: README 'Next to other "
                        "work')")
    p.add_argument("--rate", type=float, default=None)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.what == "torch":
        args.requests, args.max_tokens = args.requests or 32, args.max_tokens or 64
        result = anyio.run(bench_torch, args)
    elif args.what == "sim":
        args.requests, args.max_tokens = args.requests or 400, args.max_tokens or 128
        args.rate = args.rate or 8.0
        result = bench_sim(args)
    else:
        args.rate = args.rate or 1000.0
        result = bench_coordinator(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
