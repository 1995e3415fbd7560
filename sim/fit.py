"""Fit the iteration cost model (engine/cost_model.py) to measured step times.

Least squares on relative error (every row weighs the same whether it takes 1 ms or 1 s), with
coefficients kept >= 0: a negative one is dropped and the rest refitted, so the model never
predicts that more work takes less time.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from engine.cost_model import BatchShape, CostModel

COLUMNS = ("a_ms", "b_ms_per_prefill_token", "c_ms_per_prefill_token_sq",
           "d_ms_per_decode_seq", "e_ms_per_decode_context_token", "f_ms_per_prefill_prefix_token")


@attrs.frozen(kw_only=True)
class Fit:
    cost: CostModel
    mean_relative_error: float
    max_relative_error: float
    rows: int
    calibration: tuple[float, float, float] | None = None
    """(step factor, overhead ms per iteration, per sequence) applied after the fit, if any."""
    note: str = ""


def features(shape: BatchShape) -> list[float]:
    return [1.0, shape.prefill_tokens, shape.prefill_sq, shape.decode_seqs,
            shape.decode_context, shape.prefill_prefix]


def fit_cost_model(rows: Sequence[tuple[BatchShape, float]], *, source: str,
                   with_prefix: bool = True) -> Fit:
    """`rows` of (batch shape, measured ms) -> the non-negative relative-error fit."""
    if len(rows) < len(COLUMNS):
        raise ValueError(f"need at least {len(COLUMNS)} measurements to fit, got {len(rows)}")
    x = np.array([features(s) for s, _ in rows], dtype=np.float64)
    y = np.array([ms for _, ms in rows], dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("every measured time must be > 0")
    active = [i for i in range(len(COLUMNS)) if with_prefix or COLUMNS[i] != COLUMNS[5]]
    active = [i for i in active if np.any(x[:, i] != 0)]
    coef = np.zeros(len(COLUMNS))
    while active:
        xs = x[:, active] / y[:, None]
        # scale columns so that lstsq is well conditioned (ms/token^2 is ~1e-6)
        norm = np.linalg.norm(xs, axis=0)
        sol, *_ = np.linalg.lstsq(xs / norm, np.ones_like(y), rcond=None)
        sol = sol / norm
        if np.all(sol >= 0):
            coef[:] = 0
            coef[active] = sol
            break
        active = [i for i, v in zip(active, sol) if v >= 0]
    rel = np.abs(x @ coef - y) / y
    cost = CostModel(**{name: float(v) for name, v in zip(COLUMNS, coef)}, source=source)
    return Fit(cost=cost, mean_relative_error=float(rel.mean()),
               max_relative_error=float(rel.max()), rows=len(rows))
