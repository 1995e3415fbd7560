"""Copies that share the cores with the engine (issue 18): how much a second of swap copying
lengthens the steps and the engine's own work it overlaps, measured on recorded torch runs.

On a GPU the copy engine runs beside the SMs and the host thread, and the simulator's copy
engine is a separate resource that overlaps for free. On the CPU torch backend the swapper's
copies run in worker threads (`gpu.swap.TorchSwapper`) on the same two cores as the device
thread's steps and the event loop's planning, so a step or a gap between steps that has copies
running beside it takes longer than its shape alone predicts. A recorded run has every step's
start and end and every copy's start and end (`shunter.fidelity.recorded_run`), so for each
step and each gap we know how many milliseconds of copying ran beside it; the charge is fitted
as extra time over those milliseconds, on the steps and gaps that had copies beside them,
against models fitted on the ones that had none (`sim.profile.CopyContention`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from sim.profile import CopyContention

TRIM = 0.98
"""Leave out the rows above this quantile of excess time: a step next to another process's
burst (the same cut `fit_engine_cost` makes on the gaps)."""


class CopySpans:
    """The (began, ended) spans of a run's copies, sorted by start, asked how much copying
    falls inside a window (concurrent copies add up: two workers copying for 1 ms is 2 ms)."""

    def __init__(self, spans: Sequence[tuple[float, float]]) -> None:
        self._spans = sorted(spans)
        self._starts = [b for b, _ in self._spans]
        self._longest = max((e - b for b, e in self._spans), default=0.0)

    def __bool__(self) -> bool:
        return bool(self._spans)

    def ms(self, t0: float, t1: float) -> float:
        """Milliseconds of copying inside [t0, t1]."""
        if t1 <= t0 or not self._spans:
            return 0.0
        lo = bisect.bisect_left(self._starts, t0 - self._longest)
        hi = bisect.bisect_left(self._starts, t1)
        total = 0.0
        for b, e in self._spans[lo:hi]:
            if e > t0:
                total += min(e, t1) - max(b, t0)
        return total * 1000.0


def excess_per_copy_ms(rows: Sequence[tuple[float, float, float]]) -> tuple[float, int, float]:
    """`rows` of (measured ms, predicted ms, ms of copying beside it): the time over the
    prediction per millisecond of copying, as a ratio of totals over the rows that had copying
    (the simulator adds charges up, so totals are what must agree), >= 0; with the rows used
    and the copying they had."""
    arr = np.array([r for r in rows if r[2] > 0], dtype=np.float64).reshape(-1, 3)
    if len(arr) == 0:
        return 0.0, 0, 0.0
    excess = arr[:, 0] - arr[:, 1]
    keep = excess <= np.quantile(excess, TRIM)
    copying = float(arr[keep, 2].sum())
    if copying <= 0:
        return 0.0, 0, 0.0
    return max(0.0, float(excess[keep].sum()) / copying), int(keep.sum()), copying


def fit_contention(step_rows: Sequence[tuple[float, float, float]],
                   gap_rows: Sequence[tuple[float, float, float]], source: str) -> CopyContention:
    """The charge per millisecond of copying beside a step (`step_rows`: measured compute ms,
    the cost model's prediction, copying ms) and beside the engine's own work (`gap_rows`: the
    gap between back-to-back steps, the engine cost's prediction, copying ms). The models must
    have been fitted on the rows without copying beside them."""
    step, n_step, c_step = excess_per_copy_ms(step_rows)
    engine, n_gap, c_gap = excess_per_copy_ms(gap_rows)
    return CopyContention(
        engine=engine, step=step,
        source=f"{source}; {n_gap} gaps with {c_gap:.0f} ms of copying beside them, "
               f"{n_step} steps with {c_step:.0f} ms")
