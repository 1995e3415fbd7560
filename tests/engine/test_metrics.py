"""Metrics on hand-made timelines, with answers worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest

from engine.iteration_log import IterationLog
from engine.metrics import Goal, Percentiles, percentile, request_metrics, run_metrics, summarize
from shunter import RequestTimeline


def make_timeline(**overrides: object) -> RequestTimeline:
    fields: dict[str, object] = dict(
        request_id=1, request_class="rt", tenant="default", conversation_id=None,
        prompt_tokens=100, arrival=10.0, first_scheduled=10.1,
        token_times=(10.3, 10.4, 10.6, 10.7), finished_at=10.7, finish_reason="length")
    fields.update(overrides)
    return RequestTimeline(**fields)  # type: ignore[arg-type]


def test_one_request_by_hand():
    m = request_metrics(make_timeline(), Goal(request_class="rt", ttft_ms=250, tpot_ms=100))
    assert m.ttft_ms == pytest.approx(300.0)            # 10.3 - 10.0
    assert m.tbt_ms == pytest.approx((100.0, 200.0, 100.0))
    assert m.tpot_ms == pytest.approx(400.0 / 3)        # (10.7 - 10.3) / 3 gaps
    assert m.e2e_ms == pytest.approx(700.0)
    assert m.normalized_latency_ms == pytest.approx(175.0)  # 700 ms / 4 tokens
    assert m.queue_ms == pytest.approx(100.0)
    assert m.met_ttft is False                         # 300 > 250
    assert m.met_tpot is False                         # 133.3 > 100
    assert not m.good


def test_slos_default_to_the_timeline_and_missing_slos_are_not_judged():
    m = request_metrics(make_timeline(ttft_slo_ms=300.0001))
    assert m.met_ttft is True and m.met_tpot is None and m.good


def test_a_single_token_answer_cannot_miss_its_tpot():
    m = request_metrics(make_timeline(token_times=(10.2,), finished_at=10.2),
                        Goal(request_class="rt", ttft_ms=500, tpot_ms=1))
    assert m.tpot_ms is None and m.tbt_ms == () and m.met_tpot is True and m.good


def test_an_errored_request_meets_no_slo():
    m = request_metrics(make_timeline(finish_reason="error"), Goal(request_class="rt", ttft_ms=10_000))
    assert not m.completed and m.met_ttft is False and not m.good


def test_percentiles_interpolate_linearly():
    values = [5.0, 1.0, 3.0, 9.0, 7.0, 2.0]           # sorted: 1 2 3 5 7 9
    p = Percentiles.of(values)
    assert p.p50 == pytest.approx(4.0)                # halfway between 3 and 5
    assert p.p90 == pytest.approx(8.0)                # rank 4.5: between 7 and 9
    assert p.p999 == pytest.approx(8.99)              # rank 4.995
    assert p.mean == pytest.approx(4.5) and p.count == 6
    assert p.p99 == pytest.approx(percentile(values, 99))
    empty = Percentiles.of([])
    assert math.isnan(empty.p50) and empty.count == 0


def test_run_aggregates_by_hand():
    # Two RT requests and one BE request over a 10 s run.
    a = make_timeline(request_id=1)                                         # ttft 300, tpot 133
    b = make_timeline(request_id=2, arrival=11.0, first_scheduled=11.0,
                      token_times=(11.1, 11.15), finished_at=11.15, preemptions=2,
                      swap_stall_s=0.05)                                    # ttft 100, tpot 50
    c = make_timeline(request_id=3, request_class="be", arrival=12.0, first_scheduled=12.5,
                      token_times=(13.0, 14.0, 15.0), finished_at=15.0)     # ttft 1000, tpot 1000
    goals = {1: Goal(request_class="rt", ttft_ms=200, tpot_ms=200),
             2: Goal(request_class="rt", ttft_ms=200, tpot_ms=200),
             3: Goal(request_class="be")}
    refused = [Goal(request_class="rt", ttft_ms=200, tpot_ms=200)]
    log = IterationLog(total_blocks=10)
    for i, s in enumerate((0.001, 0.002, 0.003, 0.004)):
        log.add(now=float(i), scheduler_s=s, batch_seqs=1, batch_tokens=1, queued=0, used_blocks=5)
    log.preemptions = 2
    log.swap.copy_ops, log.swap.bytes_out, log.swap.bytes_in = 4, 300, 100
    log.swap.blocks_out, log.swap.blocks_in = 3, 1
    m = run_metrics([a, b, c], duration_s=10.0, goals=goals, failed=refused, log=log)

    assert (m.completed, m.failed) == (3, 1)
    assert m.ttft_ms.p50 == pytest.approx(300.0)                 # median of 100, 300, 1000
    assert m.ttft_ms.mean == pytest.approx(1400.0 / 3)
    # gaps: a 100,200,100; b 50; c 1000,1000 -> sorted 50 100 100 200 1000 1000
    assert m.tbt_ms.p50 == pytest.approx(150.0)
    assert m.tbt_ms.count == 6
    rt = m.slo_attainment["rt"]
    # a misses TTFT, b meets both, the refused one misses both: 1 of 3 for TTFT, 2 of 3 for TPOT
    assert rt.requests == 3
    assert rt.ttft == pytest.approx(1 / 3) and rt.tpot == pytest.approx(2 / 3)
    assert rt.all == pytest.approx(1 / 3)
    be = m.slo_attainment["be"]
    assert be.ttft is None and be.tpot is None and be.all is None
    # good: b (met both) and c (no SLO, completed) -> 2 in 10 s
    assert m.goodput_rps == pytest.approx(0.2)
    assert m.output_tokens_per_s == pytest.approx((4 + 2 + 3) / 10)
    assert m.total_tokens_per_s == pytest.approx((9 + 300) / 10)
    assert m.be_requests_per_s == pytest.approx(0.1)
    assert m.preemptions == 2
    assert m.scheduler_ms_per_iteration.p50 == pytest.approx(2.5)
    d = m.as_dict()
    assert d["swap"] == {"copy_ops": 4, "bytes_out": 300, "bytes_in": 100, "avg_copy_bytes": 100.0,
                         "blocks_out": 3, "blocks_in": 1, "copy_ops_per_block": 1.0,
                         "blocks_per_copy": 1.0, "runs": 0, "yields": 0, "step_copy_wait_ms": 0.0,
                         "reused_blocks": 0, "turn_prefix_blocks": 0, "turn_end_blocks_out": 0,
                         "sync_swap_ins": 0, "async_swap_ins": 0,
                         "stall_ms": 0.0, "request_stall_ms": d["swap"]["request_stall_ms"]}
    assert d["swap"]["request_stall_ms"]["p50"] == pytest.approx(50.0)
    assert d["requests"] == {"completed": 3, "failed": 1}
    assert set(d["ttft_ms"]) == {"p50", "p90", "p95", "p99", "p999", "mean"}


def test_summarize_still_serves_the_demo():
    s = summarize([make_timeline(), make_timeline(request_id=2, finish_reason="error")], duration_s=1.0)
    assert s.requests == 1 and s.output_tokens == 4
    assert s.ttft_ms.p50 == pytest.approx(300.0)
