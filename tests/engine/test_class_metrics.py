"""Per-class metric blocks, TPOT attainment per token, scheduler share and the cost model's
prediction error (issue 14, items 1, 7, 9, 10), on hand-made timelines and logs."""

from __future__ import annotations

import pytest

from engine.iteration_log import IterationLog
from engine.metrics import Goal, request_metrics, run_metrics
from shunter import RequestTimeline


def timeline(rid: int, cls: str, times: tuple[float, ...], **kw: object) -> RequestTimeline:
    return RequestTimeline(request_id=rid, request_class=cls, tenant="t", conversation_id=None,
                           prompt_tokens=10, arrival=0.0, first_scheduled=0.0, token_times=times,
                           finished_at=times[-1], finish_reason="length", **kw)


def test_tpot_attainment_counts_each_token_against_its_own_deadline():
    # first token at 1.0; TPOT 0.1 s: token k is due at 1.0 + 0.1 k -> 1.1, 1.2, 1.3, 1.4
    t = timeline(1, "rt", (1.0, 1.1, 1.25, 1.29, 1.5))
    m = request_metrics(t, Goal(request_class="rt", tpot_ms=100.0))
    assert (m.tpot_tokens, m.tpot_tokens_met) == (4, 2)  # 1.1 and 1.29 on time
    assert m.met_tpot is False  # (1.5 - 1.0) / 4 = 125 ms mean > 100 ms
    assert m.tpot_gaps_met == 2  # gaps 100, 150, 40, 210 ms


def test_a_stall_after_early_tokens_misses_per_gap_but_not_per_token():
    # tokens every 30 ms bank 0.7 s against the cumulative deadlines; a 0.5 s stall then misses
    # only its own gap: BROS times each token from the last one returned
    times = (1.0, 1.03, 1.06, 1.09, 1.12, 1.15, 1.18, 1.21, 1.24, 1.27, 1.30, 1.80, 1.83)
    m = request_metrics(timeline(1, "rt", times), Goal(request_class="rt", tpot_ms=100.0))
    assert m.tpot_tokens == 12
    assert m.tpot_tokens_met == 12
    assert m.tpot_gaps_met == 11
    got = run_metrics([timeline(1, "rt", times, tpot_slo_ms=100.0)], duration_s=2.0)
    assert got.by_class["rt"]["slo_attainment"]["tpot_per_gap"] == pytest.approx(11 / 12)


def test_by_class_keeps_rt_and_be_apart():
    rt = timeline(1, "rt", (0.2, 0.3, 0.4), ttft_slo_ms=400.0, tpot_slo_ms=200.0)
    late = timeline(2, "rt", (0.9, 1.0, 1.5), ttft_slo_ms=400.0, tpot_slo_ms=200.0)
    be = timeline(3, "be", (2.0, 2.1, 2.2, 2.3, 2.4))
    m = run_metrics([rt, late, be], duration_s=10.0)
    rt_block, be_block = m.by_class["rt"], m.by_class["be"]
    assert rt_block["completed"] == 2 and be_block["completed"] == 1
    assert rt_block["output_tokens_per_s"] == pytest.approx(0.6)  # 6 tokens / 10 s
    assert be_block["output_tokens_per_s"] == pytest.approx(0.5)
    assert rt_block["slo_attainment"]["ttft"] == 0.5               # 200 ms yes, 900 ms no
    # per token: rt 0.3 <= 0.4, 0.4 <= 0.6; late 1.0 <= 1.1, 1.5 > 1.3 -> 3 of 4
    assert rt_block["slo_attainment"]["tpot_per_token"] == 0.75
    # per gap: 100, 100 ms; 100, 500 ms -> 3 of 4
    assert rt_block["slo_attainment"]["tpot_per_gap"] == 0.75
    assert rt_block["normalized_latency_ms"]["mean"] == pytest.approx((400 / 3 + 500) / 2)
    assert be_block["slo_attainment"]["tpot"] is None
    assert set(m.as_dict()["by_class"]) == {"rt", "be"}


def test_scheduler_share_and_prediction_error_come_from_the_log():
    log = IterationLog(total_blocks=10)
    # iterations start at 0, 0.1, 0.2 s (0.3 s idle after); the scheduler took 5 ms, 10 ms
    for now, sched, seqs in ((0.0, 0.005, 2), (0.1, 0.010, 2), (0.2, 0.0, 0), (0.5, 0.0, 1)):
        log.add(now=now, scheduler_s=sched, batch_seqs=seqs, batch_tokens=seqs, queued=0,
                used_blocks=1)
    log.predictions.extend([(90.0, 100.0), (110.0, 100.0), (100.0, 50.0)])
    m = run_metrics([], duration_s=1.0, log=log)
    assert m.scheduler_share == pytest.approx(0.015 / 0.2)  # the empty iteration's gap left out
    assert m.cost_model_error["median"] == pytest.approx(0.1)  # errors 0.1, 0.1, 1.0
    assert m.cost_model_error["iterations"] == 3
