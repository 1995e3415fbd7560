"""What the policy is told an iteration will take, and how right that was (BROS §4.1).

The scheduler's backend either has a cost model (the simulator's profile, or a profile fitted on
this machine by `shunter profile fit`) or it has none (the torch backend by default): then the
model is fitted in the engine from its own iterations (`OnlineCostModel`). Each iteration's
prediction is kept beside the time it took, for the bench JSON's `cost_model_error`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from engine.cost_model import BatchShape, CostModel, OnlineCostModel


class _Seq(Protocol):
    start: int
    num_tokens: int


class IterationPredictor:
    def __init__(self, cost: CostModel | None) -> None:
        self._fixed = cost
        self._online = OnlineCostModel() if cost is None else None
        self._shape: BatchShape | None = None
        self._predicted: float | None = None

    @property
    def model(self) -> CostModel | None:
        """The model the policy predicts with now (None until the online fit has rows)."""
        return self._fixed if self._online is None else self._online.model

    def started(self, seqs: Iterable[_Seq]) -> None:
        shape = BatchShape.of((w.start, w.num_tokens) for w in seqs)
        model = self.model
        self._shape = shape
        self._predicted = model.predict_ms(shape) if model is not None and (
            shape.prefill_tokens or shape.decode_seqs) else None

    def finished(self, measured_ms: float) -> tuple[float, float] | None:
        """(predicted, measured) for the iteration that just ended, when there was a
        prediction; the online model learns from it."""
        shape, predicted = self._shape, self._predicted
        self._shape = self._predicted = None
        if shape is None:
            return None
        if self._online is not None:
            self._online.observe(shape, measured_ms)
        return None if predicted is None else (predicted, measured_ms)
