"""The torch engine's copier, timed from recorded runs (issue 18, round 4): the thread hops a
swap takes that the simulator's copy engine does not take by itself.

- `copy_pickup_ms`: a transfer handed to a copier with nothing to do (`gpu.swap.TorchSwapper`'s
  worker threads all asleep) starts copying once a worker has woken up and holds the
  interpreter; the engine's own thread carries on meanwhile. Measured from each such
  submission to the next copy's start. The sim's swapper starts such a copy that much later
  (`sim.swap.SimSwapper`, `EngineCost.copy_pickup_ms`).
- `stall_wake_ms`: a step that waits for a copy still running resumes once the device thread
  has woken up. Measured from the end of the last copy inside a stall to the stall's end; the
  sim adds it to every stall (`EngineCost.wake_ms`).
- `fit_swapped_in`: a step that computes sequences swapped in for it runs longer per such
  sequence (it reads KV that the copier's thread, on another core, has just written). Least
  squares of the steps' measured time on each run's own multiple of the cost model's
  prediction plus the tickets the step waited for (`CopyContention.swapped_in_ms`).

Each works on `shunter.fidelity.RecordedRun`s (typed loosely here: fidelity imports this).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.cost_model import CostModel
from shunter.contention import CopySpans


def pickups(run: Any) -> list[float]:
    """Seconds from each submission that found the copier idle (every earlier transfer had
    started, none was copying) to the next copy's start."""
    spans = sorted(run.copy_spans)
    starts = [b for b, _ in spans]
    out = []
    submits = sorted(run.swap_submits)
    for k, t in enumerate(submits):
        started = bisect.bisect_left(starts, t)  # copies that started before t
        if started != k or started >= len(starts):  # one still waits to start (or none left)
            continue
        if any(b <= t < e for b, e in spans[max(0, started - 8):started]):  # one is copying
            continue
        out.append(starts[started] - t)
    return out


def copy_pickup_ms(runs: Sequence[Any]) -> float:
    """Median ms of `pickups` over the runs that copied (0 without copies)."""
    lags = [lag for r in runs if r.copy_spans for lag in pickups(r)]
    return float(np.median(lags)) * 1000.0 if lags else 0.0


def stall_wake_ms(runs: Sequence[Any]) -> float:
    """Median ms from the end of the last copy that ended during a step's stall to the stall's
    end (the device thread's wake-up), over the steps that waited for a running copy. The
    stall is timed from the step's start on the device thread, a few microseconds before its
    wait begins, so this is a lower bound by that much."""
    wakes = []
    for r in runs:
        ends = sorted(e for _, e in r.copy_spans)
        for s in r.steps:
            if s.stall_s <= 0:
                continue
            stop = s.began + s.stall_s
            i = bisect.bisect_right(ends, stop)
            if i and ends[i - 1] > s.began:
                wakes.append(stop - ends[i - 1])
    return float(np.median(wakes)) * 1000.0 if wakes else 0.0


def fit_swapped_in(runs: Sequence[Any], cost: CostModel) -> float:
    """Step ms added per swap ticket the step waited for, >= 0: least squares over the steps
    with no copy beside them (those the cost model was fitted on) of the runs whose steps
    waited for tickets, each run with its own multiple of `cost`'s prediction (a slow spell of
    the machine moves a whole run), the top 2% of residuals left out. 0 when no step waited."""
    swapped = [r for r in runs if any(s.waited for s in r.steps)]
    if not swapped:
        return 0.0
    cols, y = [], []
    for j, r in enumerate(swapped):
        spans = CopySpans(r.copy_spans)
        for s in r.steps:
            if s.compute_ms <= 0 or spans.ms(s.began + s.stall_s, s.ended):
                continue
            row = [0.0] * (len(swapped) + 1)
            row[j], row[-1] = cost.predict_ms(s.shape), float(s.waited)
            cols.append(row)
            y.append(s.compute_ms)
    x, ys = np.array(cols), np.array(y)
    coef, *_ = np.linalg.lstsq(x, ys, rcond=None)
    res = np.abs(ys - x @ coef)
    keep = res <= np.quantile(res, 0.98)
    coef, *_ = np.linalg.lstsq(x[keep], ys[keep], rcond=None)
    return max(float(coef[-1]), 0.0)
