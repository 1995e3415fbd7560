"""Fit the iteration cost model (engine/cost_model.py) to measured step times.

BROS §4.1: the decode model is fitted on decode-only batches and the prefill model on
prefill-only ones (lengths spaced exponentially, `gpu/profiler.py`), then summed per batch; the
mixed batches are held out to check that sum. Least squares on relative error (every row weighs
the same whether it takes 1 ms or 1 s), coefficients kept >= 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from engine.cost_model import COLUMNS, BatchShape, CostModel, features, fit_coefficients, model_from

__all__ = ["COLUMNS", "Fit", "features", "fit_cost_model", "fit_recorded_steps", "relative_errors",
           "total_ratio"]


@attrs.frozen(kw_only=True)
class Fit:
    cost: CostModel
    mean_relative_error: float
    max_relative_error: float
    rows: int
    median_relative_error: float = 0.0
    held_out_median_error: float | None = None
    """Median relative error on the mixed (prefill + decode) batches, which the split fit did
    not see; None when there were none."""
    held_out_rows: int = 0
    calibration: tuple[float, float, float] | None = None
    """(step factor, overhead ms per iteration, per sequence) applied after the fit, if any."""
    note: str = ""


def relative_errors(cost: CostModel, rows: Sequence[tuple[BatchShape, float]]) -> np.ndarray:
    return np.array([abs(cost.predict_ms(s) - ms) / ms for s, ms in rows], dtype=np.float64)


def fit_cost_model(rows: Sequence[tuple[BatchShape, float]], *, source: str,
                   with_prefix: bool = True, split: bool = True) -> Fit:
    """`rows` of (batch shape, measured ms) -> the non-negative relative-error fit."""
    if len(rows) < len(COLUMNS):
        raise ValueError(f"need at least {len(COLUMNS)} measurements to fit, got {len(rows)}")
    if any(ms <= 0 for _, ms in rows):
        raise ValueError("every measured time must be > 0")
    mixed = [(s, ms) for s, ms in rows if s.prefill_tokens and s.decode_seqs]
    pure = [(s, ms) for s, ms in rows if not (s.prefill_tokens and s.decode_seqs)]
    held_out = split and len(pure) >= len(COLUMNS)
    coef = fit_coefficients(pure if held_out else rows, split=split, with_prefix=with_prefix)
    cost = model_from(coef, source)
    rel = relative_errors(cost, rows)
    mixed_rel = relative_errors(cost, mixed) if held_out and mixed else None
    return Fit(cost=cost, mean_relative_error=float(rel.mean()),
               max_relative_error=float(rel.max()), rows=len(rows),
               median_relative_error=float(np.median(rel)),
               held_out_median_error=float(np.median(mixed_rel)) if mixed_rel is not None else None,
               held_out_rows=len(mixed) if held_out else 0)


def fit_recorded_steps(rows: Sequence[tuple[BatchShape, float]], *, source: str,
                       held_out: Sequence[tuple[BatchShape, float]] = (),
                       multi_row: bool = True) -> Fit:
    """Fit on the steps a real engine ran (issue 18): one joint fit over whatever mix of
    prefill, mixed and decode batches its workloads produced (with the multi-row term,
    `CostModel.g_ms_multi_row`, unless `multi_row` is False), on relative error, then scaled
    so that the fitted steps' total time equals the measured total (a relative-error fit sits
    below the mean where step times scatter upward, and the simulator's clock adds times up).
    `held_out`: steps of other runs, to report the error on (`held_out_median_error`)."""
    if len(rows) < len(COLUMNS):
        raise ValueError(f"need at least {len(COLUMNS)} measurements to fit, got {len(rows)}")
    if any(ms <= 0 for _, ms in rows):
        raise ValueError("every measured time must be > 0")
    coef = fit_coefficients(rows, split=False, multi_row=multi_row)
    cost = model_from(coef, source)
    predicted = sum(cost.predict_ms(s) for s, _ in rows)
    scale = sum(ms for _, ms in rows) / predicted
    cost = model_from(coef * scale, source)
    rel = relative_errors(cost, rows)
    out = relative_errors(cost, held_out) if held_out else None
    return Fit(cost=cost, mean_relative_error=float(rel.mean()),
               max_relative_error=float(rel.max()), rows=len(rows),
               median_relative_error=float(np.median(rel)),
               held_out_median_error=float(np.median(out)) if out is not None else None,
               held_out_rows=len(held_out), note=f"; fitted on recorded engine steps, x{scale:.3f} "
                                                 f"to their total time")


def total_ratio(cost: CostModel, rows: Sequence[tuple[BatchShape, float]]) -> float:
    """Predicted over measured total time of `rows` (1.0: the clock adds up right)."""
    return sum(cost.predict_ms(s) for s, _ in rows) / sum(ms for _, ms in rows)
