"""The cost model's online correction (engine/cost_model_correction.py): a running median of
measured / predicted step time per phase, fed synthetic times (nothing here is timed)."""

from __future__ import annotations

import math
from array import array

import attrs
import pytest

from engine.cost_model import BatchShape, CopyCost, CostModel
from engine.cost_model_correction import CorrectedCostModel, Correction
from engine.cost_model_error import prediction_error
from engine.messages import SeqWork
from engine.prediction import IterationPredictor

BASE = CostModel(a_ms=5.0, b_ms_per_prefill_token=0.2, c_ms_per_prefill_token_sq=1e-4,
                 d_ms_per_decode_seq=0.3, e_ms_per_decode_context_token=0.002)
DECODE = [SeqWork(request_id=i, start=40, num_tokens=1, sample=True) for i in range(4)]
PREFILL = [SeqWork(request_id=9, start=0, num_tokens=64, sample=True)]


def feed(corr: Correction, ratios, *, prefill=False, predicted=10.0):
    for r in ratios:
        corr.observe(prefill=prefill, predicted_ms=predicted, measured_ms=predicted * r)


def test_a_step_change_in_speed_is_followed_within_half_the_window_plus_one():
    corr = Correction(16)
    feed(corr, [1.0] * 40)
    assert corr.factor(prefill=False) == pytest.approx(1.0)
    seen = []
    for _ in range(9):  # the host turns twice as slow
        feed(corr, [2.0])
        seen.append(corr.factor(prefill=False))
    assert all(f < 1.99 for f in seen[:8]), seen
    assert seen[8] == pytest.approx(2.0), f"9 slow steps of 16 and the factor is {seen[8]}"
    feed(corr, [0.5] * 9)  # and back, faster than the model
    assert corr.factor(prefill=False) == pytest.approx(0.5)


def test_a_single_outlier_moves_nothing():
    corr = Correction(16)
    feed(corr, [1.1] * 20)
    feed(corr, [30.0])  # one step stalled behind a neighbour
    assert corr.factor(prefill=False) == pytest.approx(1.1)
    feed(corr, [0.01])  # and one absurdly quick
    assert corr.factor(prefill=False) == pytest.approx(1.1)


def test_the_factor_is_bounded():
    corr = Correction(16, bound=4.0)
    feed(corr, [100.0] * 16)
    assert corr.factor(prefill=False) == pytest.approx(4.0)
    feed(corr, [1e-3] * 16)
    assert corr.factor(prefill=False) == pytest.approx(0.25)
    default = Correction()
    feed(default, [100.0] * 8)
    assert default.window == 8 and default.factor(prefill=False) == pytest.approx(8.0)


def test_phases_are_corrected_apart_and_a_phase_without_samples_borrows_the_other():
    corr = Correction(8, min_samples=4)
    assert corr.factor(prefill=True) == corr.factor(prefill=False) == 1.0
    feed(corr, [1.5] * 3)
    assert corr.factor(prefill=False) == 1.0  # fewer than min_samples: the model alone
    feed(corr, [1.5])
    assert corr.factor(prefill=True) == pytest.approx(1.5)  # borrowed
    feed(corr, [0.8] * 4, prefill=True)
    assert corr.factor(prefill=True) == pytest.approx(0.8)
    assert corr.factor(prefill=False) == pytest.approx(1.5)
    corr.observe(prefill=False, predicted_ms=0.0, measured_ms=5.0)  # no prediction: ignored
    assert corr.factor(prefill=False) == pytest.approx(1.5)


def test_the_corrected_model_scales_the_model_time_of_each_phase_but_not_copies():
    link = CopyCost(bandwidth_gb_per_s=1.0, dispatch_us=10.0)
    base = attrs.evolve(BASE, copy=link, block_bytes=2 ** 20)
    corr = Correction(4)
    feed(corr, [2.0] * 4)
    feed(corr, [3.0] * 4, prefill=True)
    model = corr.applied_to(base)
    assert isinstance(model, CorrectedCostModel) and corr.applied_to(base) is model
    decode, prefill = BatchShape.of([(40, 1)] * 4), BatchShape.of([(0, 64)])
    assert model.predict_ms(decode) == pytest.approx(2.0 * base.predict_ms(decode))
    assert model.predict_ms(prefill) == pytest.approx(3.0 * base.predict_ms(prefill))
    copy_ms = link.copy_ms(200, 200 * 2 ** 20)
    assert copy_ms > 3.0 * base.predict_ms(prefill)
    assert model.predict_iteration_ms(prefill, copy_blocks=200) == pytest.approx(copy_ms)
    assert Correction(4).applied_to(base) is base  # nothing learned: the model itself


def test_the_predictor_tells_the_policy_the_corrected_time_and_keeps_the_raw_one():
    pred = IterationPredictor(BASE, correction_window=8)
    raw = BASE.predict_ms(BatchShape.of([(40, 1)] * 4))
    pairs = []
    for _ in range(12):  # every decode step takes 1.5x the profile's time
        pred.started(DECODE)
        pairs.append((pred.finished(1.5 * raw), pred.last_raw_ms))
    assert pairs[0] == ((raw, 1.5 * raw), raw)
    assert pairs[-1][0][0] == pytest.approx(1.5 * raw) and pairs[-1][1] == raw
    assert pred.base_model is BASE
    assert pred.model.predict_ms(BatchShape.of([(0, 64)])) == pytest.approx(
        1.5 * BASE.predict_ms(BatchShape.of([(0, 64)])))  # prefill borrows decode's factor
    off = IterationPredictor(BASE)
    for _ in range(12):
        off.started(DECODE)
        assert off.finished(1.5 * raw) == (raw, 1.5 * raw)
    assert off.model is BASE


def test_the_online_fit_is_corrected_too():
    pred = IterationPredictor(None, correction_window=4)
    for i in range(40):
        pred.started(PREFILL if i % 5 == 0 else DECODE)
        pred.finished(12.0 if i % 5 == 0 else 6.0)
    assert pred.base_model is not None and pred.model is not pred.base_model


def test_the_error_reports_the_raw_model_beside_the_corrected_one():
    @attrs.define
    class Log:
        predictions: list = attrs.field(factory=list)
        raw_predictions: array = attrs.field(factory=lambda: array("d"))

    log = Log([(90.0, 100.0), (110.0, 100.0), (100.0, 50.0)], array("d", [80.0, 70.0, 50.0]))
    err = prediction_error(log)
    assert err["median"] == pytest.approx(0.1) and err["iterations"] == 3
    assert err["raw_median"] == pytest.approx(0.2)
    assert err["raw_p90"] == pytest.approx(0.2 + 0.8 * 0.1)
    assert math.isclose(err["raw_mean"], (0.2 + 0.3 + 0.0) / 3)
    assert "raw_median" not in prediction_error(Log(log.predictions))  # no raw kept
    assert prediction_error(Log()) is None
