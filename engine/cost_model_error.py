"""How right the cost model was (BROS §4.1; the bench JSON's `metrics.cost_model_error`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def _stats(errors: Sequence[float], prefix: str = "") -> dict[str, float]:
    a = np.asarray(errors)
    return {f"{prefix}median": float(np.median(a)), f"{prefix}p90": float(np.percentile(a, 90)),
            f"{prefix}mean": float(a.mean())}


def prediction_error(log: Any) -> dict[str, float] | None:
    """|predicted - measured| / measured over the iterations with both (median, p90, mean):
    what the policy was told. Where the log also holds the base model's own predictions
    (`raw_predictions`, one per pair: they differ when the online correction is on), the same
    three of those as raw_median, raw_p90, raw_mean."""
    pairs = getattr(log, "predictions", None)
    if not pairs:
        return None
    kept = [i for i, (_, m) in enumerate(pairs) if m > 0]
    if not kept:
        return None
    out = _stats([abs(pairs[i][0] - pairs[i][1]) / pairs[i][1] for i in kept])
    out["iterations"] = len(kept)
    raw = getattr(log, "raw_predictions", None)
    if raw is not None and len(raw) == len(pairs):
        out.update(_stats([abs(raw[i] - pairs[i][1]) / pairs[i][1] for i in kept], "raw_"))
    return out
