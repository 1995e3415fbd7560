"""N simulated instances on one virtual clock under the same coordinator, and a simulated
pipeline instance whose steps take the stage-by-stage time (bubbles and link included)."""

from __future__ import annotations

import anyio
import pytest
import trio
import trio.testing

import shunter
from engine.cluster.plan import pipeline_timing
from engine.config import EngineConfig
from engine.cost_model import CostModel
from engine.messages import ExecuteStep, SeqWork
from shunter.cluster.cluster import Cluster
from sim.network import LINKS, NetworkLink, fit_link
from sim.pipeline import SimPipelineRunner
from sim.profile import load_profile


def _virtual(fn, *args):
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


async def _serve(instances: int, policy_text: str | None, n: int, stages: int = 1):
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, pipeline_stages=stages)
    async with Cluster.start(config, instances=instances, kind="inprocess") as cluster:
        if policy_text:
            await cluster.replace_policy(policy_text)
        began = anyio.current_time()
        ends = []

        async def one(i: int) -> None:
            await anyio.sleep(i * 0.01)
            done = await cluster.complete(list(range(1, 65)), shunter.SamplingParams(
                max_tokens=32 + (i % 4) * 32, ignore_eos=True))
            ends.append(done.finish_reason)

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
        elapsed = anyio.current_time() - began
        snap = await cluster.wait_idle()
        counts = [cluster.table.dispatched_to(i) for i in range(instances)]
        runners = [inst.engine.backend.runner for inst in cluster.instances]
    return elapsed, ends, counts, snap, runners


def test_simulated_instances_share_one_clock_and_the_coordinator():
    one, ends1, _, _, _ = _virtual(_serve, 1, None, 60)
    least_load = "policy lb { dispatch least_load }"
    three, ends3, counts, snap, runners = _virtual(_serve, 3, least_load, 60)
    assert ends1 == ends3 == ["length"] * 60
    assert counts == [20, 20, 20] or (sum(counts) == 60 and min(counts) >= 15), counts
    assert all(s.idle for s in snap.snapshots)
    # three devices ran at once on the one virtual clock: each was busy, and together they
    # took no longer than one device alone (decode at this size is bound by weight reads, so
    # a third of the batch costs almost as much per step)
    assert all(r.steps > 0 and r.busy_s > 0 for r in runners)
    assert three <= one


def test_a_simulated_pipeline_step_takes_the_stage_by_stage_time():
    cost = CostModel(a_ms=10.0, b_ms_per_prefill_token=0.0, c_ms_per_prefill_token_sq=0.0,
                     d_ms_per_decode_seq=0.0, e_ms_per_decode_context_token=0.0)
    model = load_profile("llama3-8b-a100").model
    link = NetworkLink(name="test", latency_s=1e-3, bytes_per_s=1e12)
    runner = SimPipelineRunner(cost, 100, model=model, stages=2, microbatches=4, link=link)
    step = ExecuteStep(step_id=1, release=(), setups=(), blocks=(), seqs=tuple(
        SeqWork(request_id=i, start=10, num_tokens=1, sample=True) for i in range(8)))

    async def run():
        began = anyio.current_time()
        done = await runner.step(step)
        return anyio.current_time() - began, done

    took, done = _virtual(run)
    # each microbatch costs 10 ms x half the layers on each stage; its 2 tokens of hidden
    # states cross the link in 1 ms + 2 x 4096 x 2 bytes / 1e12
    send = 1e-3 + 2 * model.hidden_size * model.dtype_bytes / 1e12
    want = pipeline_timing([[5e-3] * 4] * 2, [send] * 4)
    assert took == pytest.approx(want.makespan)
    assert want.makespan == pytest.approx(5 * 5e-3 + send)
    assert runner.totals.bubble_ratio == pytest.approx(want.bubble_ratio)
    assert [t.request_id for t in done.sampled] == list(range(8))


def test_a_pipeline_instance_serves_on_the_simulator():
    _, ends, _, _, runners = _virtual(_serve, 1, None, 12, 2)
    assert ends == ["length"] * 12
    assert runners[0].totals.steps > 0 and 0 < runners[0].totals.bubble_ratio < 1


def test_the_shipped_link_is_the_fit_of_vidurs_measurements():
    from pathlib import Path

    shared = Path(__file__).resolve().parents[3] / "shared"
    path = shared / "profiles/vidur/network/a100_dgx/send_recv.csv.gz"
    if not path.exists():
        pytest.skip(f"{path} is not next to this checkout")
    fit = fit_link(path, devices_per_node=1, name="a100-internode")
    shipped = LINKS["a100-internode"]
    assert fit.latency_s == pytest.approx(shipped.latency_s, rel=0.01)
    assert fit.bytes_per_s == pytest.approx(shipped.bytes_per_s, rel=0.01)


def test_shunter_bench_runs_a_workload_through_simulated_instances():
    import argparse

    from shunter.benchmark.policies import parse_policy
    from shunter.benchmark.run import run_one
    from shunter.workloads import load_workload

    w = load_workload("rtbe:rate=20,duration=3")
    base = EngineConfig(backend="sim", record_iterations=True)
    one = run_one(parse_policy("fcfs"), w, base, progress=False)
    two = run_one(parse_policy("fcfs"), w, base, progress=False,
                  cluster=argparse.Namespace(instances=2, cluster="local"))
    assert one.error is None and two.error is None, (one.error, two.error)
    assert two.metrics.completed == one.metrics.completed > len(w.requests) // 2
    assert two.metrics.failed == one.metrics.failed == 0
    # two simulated GPUs drain the same arrivals with lower latency than one
    assert two.metrics.e2e_ms.p50 < one.metrics.e2e_ms.p50


def test_an_instance_whose_engine_stops_is_marked_down_and_its_requests_end():
    async def run():
        config = EngineConfig(backend="sim", cpu_swap_blocks=0)
        async with Cluster.start(config, instances=2, kind="inprocess",
                                 monitor_interval_s=0.01) as cluster:
            params = shunter.SamplingParams(max_tokens=200, ignore_eos=True)
            streams = [cluster.generate(list(range(1, 33)), params) for _ in range(4)]
            firsts = [await s.__anext__() for s in streams]  # round robin: 0, 1, 0, 1
            doomed = cluster.instances[1].engine
            await doomed._scheduler_send.send("not a message")  # its scheduler fails
            ends = []
            with anyio.fail_after(60):  # virtual seconds: a request left without an end hangs
                for s in streams:
                    async for chunk in s:
                        if chunk.finish_reason:
                            ends.append((chunk.finish_reason, chunk.error))
            await anyio.sleep(0.1)  # a monitor round
            after = await cluster.complete(list(range(1, 9)), shunter.SamplingParams(
                max_tokens=4, ignore_eos=True))
            snap = await cluster.inspect()
        return firsts, ends, after, snap, cluster

    firsts, ends, after, snap, cluster = _virtual(run)
    assert all(f.token_ids for f in firsts)
    assert [e[0] for e in ends] == ["length", "error", "length", "error"]
    assert all(e[1].startswith("the scheduler actor failed") for e in ends[1::2])
    assert after.finish_reason == "length"
    assert [v.alive for v in snap.views] == [True, False]
    assert snap.failures[1].startswith("instance 1: the scheduler actor failed")
    assert cluster.table.dispatched_to(1) == 2
