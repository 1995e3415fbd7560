"""The iteration cost model (BROS §4.1): the split prefill/decode fit, the copy-time model,
the online fit a torch engine predicts with, and the predictor's (predicted, measured) pairs."""

from __future__ import annotations

import pytest

from engine.cost_model import (
    BatchShape,
    CopyCost,
    CostModel,
    OnlineCostModel,
    fit_coefficients,
    iteration_ms,
    model_from,
)
from engine.messages import SeqWork
from engine.prediction import IterationPredictor
from sim.fit import fit_cost_model

TRUE = CostModel(a_ms=5.0, b_ms_per_prefill_token=0.2, c_ms_per_prefill_token_sq=1e-4,
                 d_ms_per_decode_seq=0.3, e_ms_per_decode_context_token=0.002,
                 f_ms_per_prefill_prefix_token=3e-5)
PREFILLS = [[(0, 2 ** k)] for k in range(3, 10)] + [[(256, 64)], [(1024, 256)]]
DECODES = [[(2 ** c, 1)] * 2 ** b for b in range(6) for c in range(4, 11)]
MIXED = [[(0, 128)] + [(256, 1)] * 16, [(0, 256)] + [(512, 1)] * 32]


def rows(batches, cost=TRUE, noise=None):
    out = []
    for i, b in enumerate(batches):
        shape = BatchShape.of(b)
        ms = cost.predict_ms(shape)
        out.append((shape, ms * (1 + noise[i % len(noise)]) if noise else ms))
    return out


def test_prefill_and_decode_are_fitted_apart_and_the_sum_predicts_mixed_batches():
    fit = fit_cost_model(rows(PREFILLS + DECODES + MIXED), source="test")
    assert fit.held_out_rows == len(MIXED) and fit.held_out_median_error < 1e-9
    for name in ("a_ms", "b_ms_per_prefill_token", "d_ms_per_decode_seq",
                 "e_ms_per_decode_context_token"):
        assert getattr(fit.cost, name) == pytest.approx(getattr(TRUE, name), rel=1e-6)


def test_the_split_fit_falls_back_to_one_fit_without_pure_batches():
    coef = fit_coefficients(rows(MIXED * 4 + [[(0, 64)] + [(100, 1)] * 3]))
    assert all(c >= 0 for c in coef)


def test_copy_time_is_calls_times_dispatch_plus_bytes_over_bandwidth():
    link = CopyCost(bandwidth_gb_per_s=25.0, dispatch_us=10.0)
    assert link.copy_ms(calls=64, nbytes=2 * 2 ** 20) == pytest.approx(0.64 + 2 * 2 ** 20 / 25e6)
    assert iteration_ms(20.0, 5.0) == 20.0                     # async: overlapped
    assert iteration_ms(20.0, 5.0, overlapped=False) == 25.0   # sync: the step waits


def test_the_online_model_learns_the_engine_from_its_own_iterations():
    online = OnlineCostModel(min_rows=8, refit_every=4)
    noise = [0.03, -0.02, 0.01, -0.03, 0.02]
    for shape, ms in rows(DECODES[:20] + PREFILLS + DECODES[20:], noise=noise):
        online.observe(shape, ms)
    assert online.model is not None and "fitted in this engine" in online.model.source
    for b in MIXED:
        shape = BatchShape.of(b)
        assert online.model.predict_ms(shape) == pytest.approx(TRUE.predict_ms(shape), rel=0.1)


def test_the_predictor_pairs_each_prediction_with_the_measured_time():
    fixed = IterationPredictor(model_from([10.0, 0, 0, 1.0, 0, 0], "test"))
    fixed.started([SeqWork(request_id=1, start=5, num_tokens=1, sample=True)] * 3)
    assert fixed.finished(14.0) == (13.0, 14.0)
    learning = IterationPredictor(None)
    assert learning.model is None
    for _ in range(8):
        learning.started([SeqWork(request_id=1, start=5, num_tokens=1, sample=True)])
        assert learning.finished(11.0) is None or learning.model is not None
    assert learning.model is not None and learning.model.predict_ms(BatchShape.of([(5, 1)])) > 0
