"""KunServe on simulated instances (one virtual clock): a burst overloads two instances, the
coordinator's monitor forms a group while requests are in flight (the head adopts them, its
pool grows by the dropped weights, the KV is exchanged, requests wait for their own chunks),
every request finishes with all its tokens, and once the load falls the group is restored."""

from __future__ import annotations

import anyio
import pytest
import trio
import trio.testing

import shunter
from engine.config import EngineConfig
from policies import policy_path
from shunter.cluster.cluster import Cluster
from sim.exchange import SimExchange
from sim.network import NetworkLink
from tests.sim.kunserve_burst import start_burst


def _virtual(fn, *args):
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


async def _burst(policy: str, n: int = 40):
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300,
                          policy=policy_path(policy))
    async with Cluster.start(config, instances=2, kind="inprocess") as cluster:
        done = []
        with anyio.fail_after(120):  # virtual seconds: a lost request fails here
            async with anyio.create_task_group() as tg:
                start_burst(tg, cluster, done, n, max_tokens=200)
            snap = await cluster.wait_idle()
            # low load: 4 calm seconds (kunserve.policy's hold), then the restore
            # copies 8 GB of layers per link (1 s)
            await anyio.sleep(7.0)
            after = await cluster.inspect()
        ends = [(d.finish_reason, len(d.token_ids), d.timeline.ttft_s) for d in done]
        return ends, snap, after, cluster.groups


def test_a_burst_forms_a_group_in_flight_and_restores_it():
    ends, snap, after, groups = _virtual(_burst, "kunserve")
    assert sorted({(r, k) for r, k, _ in ends}) == [("length", 200)] and len(ends) == 40
    c = groups.counters
    assert c.drops == 1 and c.groups_formed == 1 and c.restores == 1
    # requests running on the member continued on the head: adopted with their KV
    assert c.adopted_requests > 0 and c.kv_exchanged_bytes > 0
    group = c.events[0]
    # two pools of 300 blocks and one copy of Llama-3-8B's decoder layers (32 x 209 blocks
    # of 2 MiB; the global tensors stay on both: tests/sim/test_kunserve_group_pool.py)
    assert sorted(group["members"]) == [0, 1] and group["pool_blocks"] == 600 + 6688
    assert all(s.allocator.allocated_blocks == 0 for s in snap.snapshots)
    assert [s.scheduler.total_blocks for s in after.snapshots] == [300, 300]  # restored
    assert 0 < groups.bubble_ratio() < 0.5


def test_without_kunserve_the_burst_queues():
    fcfs, _, _, groups = _virtual(_burst, "fcfs")
    kun, _, _, _ = _virtual(_burst, "kunserve")
    assert groups is None
    assert max(t for *_, t in kun) < 0.5 * max(t for *_, t in fcfs)


@pytest.mark.parametrize("coordinated", [False, True])
def test_activations_wait_behind_fifo_kv_but_one_chunk_at_most_when_coordinated(coordinated):
    link = NetworkLink(name="t", latency_s=0.0, bytes_per_s=1e9)
    x = SimExchange(link, coordinated=coordinated, chunk_bytes=1_000_000)  # 1 ms chunks
    arrived = {}

    async def run():
        async def note(rid):
            arrived[rid] = anyio.current_time()

        async with anyio.create_task_group() as tg:
            tg.start_soon(x.run, [(1, 10_000_000), (2, 10_000_000)], note)  # 10 ms each
            await anyio.sleep(0.0025)
            wait = x.activation_wait(anyio.current_time())
            x.note_activations(anyio.current_time(), 0.004)  # 4 ms of activations cut in
        return wait

    wait = _virtual(run)
    if coordinated:  # the rest of the chunk on the wire, then the activations go first
        assert wait == pytest.approx(0.0005)
        assert arrived == {1: pytest.approx(0.014), 2: pytest.approx(0.024)}
    else:  # behind the whole queue; the KV is not delayed
        assert wait == pytest.approx(0.0175)
        assert arrived == {1: pytest.approx(0.010), 2: pytest.approx(0.020)}


def test_the_bench_json_records_a_cluster_block_for_kunserve_runs():
    import argparse

    from shunter.benchmark.policies import parse_policy
    from shunter.benchmark.run import run_one, runs_json
    from shunter.workloads import load_workload

    workload = load_workload("sharegpt:requests=60,rate=60,max_input=1500,max_output=300",
                             seed=0)
    base = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300)
    args = argparse.Namespace(instances=2, cluster="local")
    runs = runs_json([run_one(parse_policy(p), workload, base, progress=False, cluster=args)
                      for p in ("kunserve", "fcfs")])
    kun, fcfs = runs
    assert "cluster" not in fcfs and "error" not in kun
    c = kun["cluster"]
    assert c["drops"] >= 1 and c["groups_formed"] >= 1 and c["kv_exchanged_bytes"] > 0
    assert 0 <= c["bubble_ratio"] < 1 and c["cost_model_error"] < 0.05
    sample = c["kv_usage"][-1]
    assert len(sample["used"]) == len(sample["pool"]) == 2 and sample["t"] >= 0
    # each sample's demand is what the restore rule reads: against the pre-drop capacity (two
    # pools of 300), not the grown pool, so while grouped it is at least the KV held over 600
    grouped = [s for s in c["kv_usage"] if any(s["dropped_layers"]) and any(s["used"])]
    assert grouped and all(s["demand"] >= sum(u or 0 for u in s["used"]) / 600 - 1e-9
                           for s in grouped)
    assert max(s["demand"] for s in grouped) > max(
        sum(u or 0 for u in s["used"]) / sum(s["pool"]) for s in grouped)


def test_an_engine_reports_the_oldest_queued_request_s_kv_as_its_head_of_line_demand():
    """`head_tokens` (what KunServe's drop condition reads): the context of the oldest waiting
    request, not the whole queue's (`queued_tokens`) and not the largest one's."""
    from shunter.engine import Engine

    async def main():
        config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=40)
        async with Engine.start(config) as engine, anyio.create_task_group() as tg:
            for i, n in enumerate((300, 300, 200, 350)):  # 19 + 19 blocks run, 2 are free
                tg.start_soon(_late, engine, i * 0.001, n)
            await anyio.sleep(0.1)  # both first requests decoding
            snap = (await engine.inspect()).scheduler
            tg.cancel_scope.cancel()
        return snap

    async def _late(engine, delay, n):
        await anyio.sleep(delay)
        await engine.complete([5] * n, shunter.SamplingParams(max_tokens=200, ignore_eos=True))

    snap = _virtual(main)
    assert (snap.running, snap.waiting) == (2, 2)
    assert snap.head_tokens == 200 and snap.queued_tokens == 550


def test_an_engine_reports_the_kv_its_running_prompts_still_need():
    """`pending_tokens` (the running demand KunServe's drop condition adds, §4.1): a 300-token
    prompt prefilled 64 tokens a step is running with the rest of its prompt still to get KV."""
    from shunter.engine import Engine

    async def main():
        config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=40,
                              max_batched_tokens=64)
        async with Engine.start(config) as engine, anyio.create_task_group() as tg:
            tg.start_soon(_late, engine, 0.0, 300)
            await anyio.sleep(0.001)  # mid-prefill: 5 steps of at most 64 tokens
            snap = (await engine.inspect()).scheduler
            tg.cancel_scope.cancel()
        return snap

    async def _late(engine, delay, n):
        await anyio.sleep(delay)
        await engine.complete([5] * n, shunter.SamplingParams(max_tokens=20, ignore_eos=True))

    snap = _virtual(main)
    assert (snap.running, snap.waiting) == (1, 0)
    assert 0 < snap.pending_tokens < 300 and (300 - snap.pending_tokens) % 64 == 0
