"""What the policy is told an iteration will take, and how right that was (BROS §4.1).

The scheduler's backend either has a cost model (the simulator's profile, or a profile fitted on
this machine by `shunter profile fit`) or it has none (the torch backend by default): then the
model is fitted in the engine from its own iterations (`OnlineCostModel`). With a correction
window (`EngineConfig.cost_correction`, torch backend) that model is the base and the policy
predicts with it times a running median of measured / predicted per phase
(engine/cost_model_correction.py), so a profile goes on predicting as the host's speed drifts.
Each iteration's prediction is kept beside the time it took, and the base model's own beside
them, for the bench JSON's `cost_model_error` (corrected and raw).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from engine.cost_model import BatchShape, CostModel, OnlineCostModel
from engine.cost_model_correction import Correction


class _Seq(Protocol):
    start: int
    num_tokens: int


class IterationPredictor:
    def __init__(self, cost: CostModel | None, *, correction_window: int = 0) -> None:
        self._fixed = cost
        self._online = OnlineCostModel() if cost is None else None
        self._correction = Correction(correction_window) if correction_window else None
        self._shape: BatchShape | None = None
        self._predicted: float | None = None
        self._raw: float | None = None
        self.last_raw_ms: float | None = None
        """The base model's prediction (uncorrected) of the iteration `finished` last paired."""

    @property
    def base_model(self) -> CostModel | None:
        """The profile's model, or the online fit (None until it has rows): uncorrected."""
        return self._fixed if self._online is None else self._online.model

    @property
    def model(self) -> CostModel | None:
        """The model the policy predicts with now: the base model, corrected when on."""
        base = self.base_model
        return base if base is None or self._correction is None else (
            self._correction.applied_to(base))

    def correction_factors(self) -> tuple[float, float] | None:
        """(decode, prefill): what the base model's predictions are multiplied by now; None
        with the correction off."""
        c = self._correction
        return None if c is None else (c.factor(prefill=False), c.factor(prefill=True))

    def started(self, seqs: Iterable[_Seq]) -> None:
        shape = BatchShape.of((w.start, w.num_tokens) for w in seqs)
        base = self.base_model
        self._shape = shape
        self._predicted = self._raw = None
        if base is not None and (shape.prefill_tokens or shape.decode_seqs):
            self._raw = base.predict_ms(shape)
            self._predicted = self._raw if self._correction is None else (
                self._correction.applied_to(base).predict_ms(shape))

    def finished(self, measured_ms: float) -> tuple[float, float] | None:
        """(predicted, measured) for the iteration that just ended, when there was a
        prediction (`last_raw_ms`: the base model's); the online model and the correction
        learn from it."""
        shape, predicted, raw = self._shape, self._predicted, self._raw
        self._shape = self._predicted = self._raw = None
        self.last_raw_ms = raw
        if shape is None:
            return None
        if self._online is not None:
            self._online.observe(shape, measured_ms)
        if self._correction is not None and raw is not None:
            self._correction.observe(prefill=shape.prefill_tokens > 0, predicted_ms=raw,
                                     measured_ms=measured_ms)
        return None if predicted is None else (predicted, measured_ms)
