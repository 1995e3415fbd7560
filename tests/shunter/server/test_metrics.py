"""`/metrics`: a known workload, then the exposition parsed with prometheus-client's own parser;
every counter and histogram count must match what was served."""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from policies import policy_path
from shunter import Engine, EngineConfig, SamplingParams, SchedulingParams
from shunter.server.metrics import TTFT_BUCKETS, ServerMetrics
from tests.fakes import fake_backend



CONFIG = EngineConfig(block_size=4, max_num_seqs=8, max_batched_tokens=64,
                      policy=policy_path("round_robin_rtbe"))


async def scrape(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}, through the route."""
    app = Starlette(routes=metrics.routes())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": "m", **labels}.items())))]


@pytest.mark.anyio
async def test_counters_and_histograms_match_the_served_workload():
    async with Engine.start(CONFIG, backend=fake_backend(64, 4, step_delay=0.001)) as engine:
        metrics = ServerMetrics(engine, model_name="m")
        served = []
        for n, (cls, max_tokens) in enumerate([("rt", 4), ("rt", 5), ("be", 3), ("be", 1)]):
            scheduling = SchedulingParams(request_class=cls, tpot_ms=1e-6 if n == 1 else None)
            async for last in engine.generate([1 + n, 2, 3], SamplingParams(
                    max_tokens=max_tokens, ignore_eos=True), scheduling=scheduling):
                pass
            metrics.on_finished(last, last.finish_reason, scheduling)
            served.append(last)
        stream = engine.generate([9, 9, 9, 9, 9], SamplingParams(max_tokens=50, ignore_eos=True))
        async for chunk in stream:
            break
        await stream.aclose()  # cancelled: its client reads nothing more
        metrics.on_finished(None, "cancelled", SchedulingParams())
        await engine.wait_idle()
        samples = await scrape(metrics)

    assert value(samples, "shunter:request_success_total", finished_reason="length") == 4
    assert value(samples, "shunter:request_success_total", finished_reason="cancelled") == 1
    assert value(samples, "shunter:prompt_tokens_total") == 4 * 3
    assert value(samples, "shunter:generation_tokens_total") == 4 + 5 + 3 + 1
    for cls, n, gaps in (("rt", 2, 3 + 4), ("be", 2, 2 + 0)):
        assert value(samples, "shunter:e2e_request_latency_seconds_count", request_class=cls) == n
        assert value(samples, "shunter:time_to_first_token_seconds_count", request_class=cls) == n
        assert value(samples, "shunter:request_queue_time_seconds_count", request_class=cls) == n
        assert value(samples, "shunter:inter_token_latency_seconds_count", request_class=cls) == gaps
        inf = value(samples, "shunter:time_to_first_token_seconds_bucket", request_class=cls,
                    le="+Inf")
        assert inf == n
    ttft_sum = sum(d.timeline.ttft_s for d in served if d.timeline.request_class == "rt")
    assert value(samples, "shunter:time_to_first_token_seconds_sum",
                 request_class="rt") == pytest.approx(ttft_sum)
    buckets = {k[1] for k in samples if k[0] == "shunter:time_to_first_token_seconds_bucket"}
    assert len(buckets) == 2 * (len(TTFT_BUCKETS) + 1)
    # rt's deadlines come from the class (TTFT 400 ms, TPOT 200 ms) or the request (a TPOT of
    # 1 ns nobody meets); be has none
    assert value(samples, "shunter:slo_attained_total", request_class="rt", metric="ttft") == 2
    assert value(samples, "shunter:slo_attained_total", request_class="rt", metric="tpot") == 1
    assert value(samples, "shunter:slo_missed_total", request_class="rt", metric="tpot") == 1
    assert not [k for k in samples
                if k[0].startswith("shunter:slo_") and ("request_class", "be") in k[1]]
    # engine-side, read at scrape time
    assert value(samples, "shunter:num_requests_running") == 0
    assert value(samples, "shunter:num_requests_waiting") == 0
    assert value(samples, "shunter:num_requests_swapped") == 0
    assert value(samples, "shunter:kv_cache_usage_perc") == 0.0
    assert value(samples, "shunter:num_preemptions_total") == 0
    assert value(samples, "shunter:swap_bytes_total", direction="out") == 0
    assert value(samples, "shunter:overload_trigger", trigger="drop") == 0
    assert samples[("shunter:policy_info", (("name", "round_robin_rtbe"), ("version", "1")))] == 1



SIM = EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=24, cpu_swap_blocks=96,
                   max_num_seqs=8, policy=policy_path("fastswitch_markov"),
                   record_iterations=True)


def test_swap_totals_are_read_without_consuming_them():
    async def main():
        async with Engine.start(SIM) as engine:
            metrics = ServerMetrics(engine, model_name="m")
            params = SamplingParams(max_tokens=64, ignore_eos=True)
            async with trio.open_nursery() as nursery:
                for n in range(8):
                    nursery.start_soon(engine.complete, [1 + n] * 40, params)
            await engine.wait_idle()
            first, second = await scrape(metrics), await scrape(metrics)
            swap = (await engine.inspect()).swap
            taken = await engine.take_iteration_log()
            return first, second, swap, taken

    first, second, swap, taken = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert first == second  # scraping resets nothing
    assert swap.bytes_out > 0 and swap.bytes_in > 0 and swap.copy_ops_in > 0
    assert value(first, "shunter:swap_bytes_total", direction="out") == swap.bytes_out
    assert value(first, "shunter:swap_bytes_total", direction="in") == swap.bytes_in
    assert value(first, "shunter:swap_copy_calls_total", direction="in") == swap.copy_ops_in
    assert value(first, "shunter:swap_copy_calls_total",
                 direction="out") == swap.copy_ops - swap.copy_ops_in
    assert value(first, "shunter:swap_stall_seconds_total") == pytest.approx(swap.stall_s)
    assert value(first, "shunter:num_preemptions_total") > 0
    assert taken.swap.bytes_out == swap.bytes_out  # the take still sees all of it


@pytest.mark.anyio
async def test_a_real_server_counts_what_it_served():
    from shunter.server import ServerSettings
    from tests.shunter.server.conftest import serving

    config = EngineConfig(backend="sim", block_size=16, policy=policy_path("round_robin_rtbe"))
    async with serving(config, ServerSettings(served_model_name="m")) as s, \
            httpx.AsyncClient(base_url=s.url, timeout=30) as http:
        for n, (cls, stream) in enumerate([("rt", False), ("be", True), ("rt", True)]):
            r = await http.post("/v1/completions", json={
                "prompt": [1, 2, 3, 4 + n], "max_tokens": 4 + n, "ignore_eos": True,
                "stream": stream, "request_class": cls})
            assert r.status_code == 200, r.text
        refused = await http.post("/v1/completions", json={"prompt": [1], "n": 2})
        assert refused.status_code == 400
        r = await http.get("/metrics")
        assert r.status_code == 200
        samples = {}
        for family in text_string_to_metric_families(r.text):
            for x in family.samples:
                samples[(x.name, tuple(sorted(x.labels.items())))] = x.value
    assert value(samples, "shunter:request_success_total", finished_reason="length") == 3
    assert value(samples, "shunter:prompt_tokens_total") == 3 * 4
    assert value(samples, "shunter:generation_tokens_total") == 4 + 5 + 6
    assert value(samples, "shunter:e2e_request_latency_seconds_count", request_class="rt") == 2
    assert value(samples, "shunter:inter_token_latency_seconds_count", request_class="rt") == 3 + 5
    assert value(samples, "shunter:time_to_first_token_seconds_count", request_class="be") == 1
    assert samples[("shunter:policy_info", (("name", "round_robin_rtbe"), ("version", "1")))] == 1


def test_the_cost_models_correction_is_a_gauge_per_phase():
    """The scheduler's snapshot carries the online correction's factors (decode, prefill) and
    `/metrics` shows each under its phase; with the correction off there is no such gauge."""
    from types import SimpleNamespace

    from engine.cost_model import BatchShape, CostModel
    from engine.scheduler_stats import SchedulerStats

    cost = CostModel(a_ms=1.0, b_ms_per_prefill_token=0.1, c_ms_per_prefill_token_sq=0.0,
                     d_ms_per_decode_seq=0.1, e_ms_per_decode_context_token=0.0)
    stats = SchedulerStats(total_blocks=8, record_iterations=False, cost=cost,
                           correction_window=8)
    prefill, decode = [SimpleNamespace(start=0, num_tokens=10)], [
        SimpleNamespace(start=10, num_tokens=1)]
    for seqs, slower in ((prefill, 3.0),) * 4 + ((decode, 0.5),) * 4:
        stats.record_iteration(now=0.0, scheduler_s=0.0, batch_seqs=1, batch_tokens=1,
                               queued=0, used_blocks=0, seqs=seqs)
        shape = BatchShape.of((w.start, w.num_tokens) for w in seqs)
        stats.step_done(slower * cost.predict_ms(shape))

    def scheduler_snapshot(s: SchedulerStats):
        return s.snapshot(iteration=8, policy="fcfs", policy_version=1, requests=(),
                          free_blocks=8, iteration_ms=1.0, copies=None)

    snap = scheduler_snapshot(stats)
    assert snap.cost_correction == pytest.approx((0.5, 3.0))
    off = SchedulerStats(total_blocks=8, record_iterations=False, cost=cost)
    assert scheduler_snapshot(off).cost_correction is None

    class Stub:
        policy = SimpleNamespace(settings=SimpleNamespace(name="fcfs"))
        policy_version = 1

        def __init__(self, scheduler):
            self.scheduler = scheduler

        async def inspect(self):
            from engine.snapshots import AllocatorSnapshot, EngineSnapshot

            return EngineSnapshot(scheduler=self.scheduler, allocator=AllocatorSnapshot(
                free_blocks=8, allocated_blocks=0, total_blocks=8, tables={}))

    samples = trio.run(scrape, ServerMetrics(Stub(snap), model_name="m"))
    assert value(samples, "shunter:cost_model_correction", phase="decode") == pytest.approx(0.5)
    assert value(samples, "shunter:cost_model_correction", phase="prefill") == pytest.approx(3.0)
    samples = trio.run(scrape, ServerMetrics(Stub(scheduler_snapshot(off)), model_name="m"))
    assert not any(name == "shunter:cost_model_correction" for name, _ in samples)
