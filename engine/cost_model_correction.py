"""The cost model corrected online by the iterations the engine measures (BROS §4.1's profiled
model stays the base).

A model fitted once goes stale as the machine's speed drifts: a busier host, heat, another
clock. Steps then take some factor longer (or shorter) than the model says, and the same
factor for a while. `Correction` keeps, per phase (steps with prefill tokens; decode-only
steps), the ratios measured / predicted of the latest `window` steps and scales the model's
prediction by their median (taken on the log ratios): one step slowed by a neighbour does not
move it, and a lasting change in speed takes over once it holds more than half the window
(`window // 2 + 1` steps). A phase with fewer than `min_samples` ratios borrows the other
phase's factor (drift from the host moves both), else predicts with the model unchanged. The
factor stays within [1 / `bound`, `bound`] (8: a profile fitted on this 2-core host when quiet
ran 4x slower in median at load 4-5, bench/results/bros_cost_round11.md): a run of stalls cannot
make the policy believe a step takes minutes.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import attrs

from engine.cost_model import CostModel

DEFAULT_WINDOW = 8
"""`EngineConfig.cost_correction`'s default: steps per phase the running median covers."""


@attrs.frozen(kw_only=True)
class CorrectedCostModel(CostModel):
    """`CostModel`'s prediction of the model time times the factor of the step's phase (copies,
    another resource, are not scaled)."""

    decode_factor: float = 1.0
    prefill_factor: float = 1.0

    def model_ms(self, prefill_tokens: int, prefill_sq: int, prefill_prefix: int,
                 decode_seqs: int, decode_context: int) -> float:
        return super().model_ms(prefill_tokens, prefill_sq, prefill_prefix, decode_seqs,
                                decode_context) * (
            self.prefill_factor if prefill_tokens else self.decode_factor)


class Correction:
    """Running median ratios of measured to predicted step time, per phase."""

    def __init__(self, window: int = DEFAULT_WINDOW, *, min_samples: int = 4,
                 bound: float = 8.0) -> None:
        if window < 1:
            raise ValueError(f"Correction: window must be >= 1, got {window}")
        if bound < 1.0:
            raise ValueError(f"Correction: bound must be >= 1, got {bound}")
        self.window, self._min, self._log_bound = window, min(min_samples, window), math.log(bound)
        self._ratios = {True: deque(maxlen=window), False: deque(maxlen=window)}
        self._log_factor = {True: 0.0, False: 0.0}
        self._base: CostModel | None = None
        self._corrected: CostModel | None = None

    def observe(self, *, prefill: bool, predicted_ms: float, measured_ms: float) -> None:
        """A step of that phase was predicted to take `predicted_ms` by the base model and took
        `measured_ms`."""
        if not (predicted_ms > 0 and measured_ms > 0):
            return
        ratios = self._ratios[prefill]
        ratios.append(math.log(measured_ms / predicted_ms))
        if len(ratios) >= self._min:
            b = self._log_bound
            self._log_factor[prefill] = min(b, max(-b, statistics.median(ratios)))
            self._corrected = None

    def factor(self, *, prefill: bool) -> float:
        """What the base model's prediction of a step of that phase is multiplied by."""
        if len(self._ratios[prefill]) >= self._min:
            return math.exp(self._log_factor[prefill])
        if len(self._ratios[not prefill]) >= self._min:
            return math.exp(self._log_factor[not prefill])
        return 1.0

    def applied_to(self, base: CostModel) -> CostModel:
        """`base` with this correction (the same object until a factor or the base changes)."""
        if self._corrected is None or self._base is not base:
            decode, prefill = self.factor(prefill=False), self.factor(prefill=True)
            self._base = base
            self._corrected = CorrectedCostModel(
                **{f.name: getattr(base, f.name) for f in attrs.fields(CostModel)},
                decode_factor=decode, prefill_factor=prefill) if (decode, prefill) != (
                1.0, 1.0) else base
        return self._corrected
