"""The comparison table `shunter bench` prints: one row per policy."""

from __future__ import annotations

import math
from collections.abc import Sequence

from shunter.benchmark.run import RunOutcome
from shunter.plain_text import plain_table, plain_text

COLUMNS = ("policy", "done", "fail", "TTFT p50", "TTFT p99", "TBT p99", "TPOT p50", "e2e p50",
           "SLO ok", "goodput/s", "out tok/s", "BE req/s", "preempt", "swap MB", "sched ms",
           "wall s")


def _num(v: float, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}"


def row(o: RunOutcome) -> list[str]:
    if o.metrics is None:
        return [o.label, "-", "-", f"failed: {o.error.splitlines()[0]}"]
    m = o.metrics
    good = [a.all for a in m.slo_attainment.values() if a.all is not None]
    slo = f"{100 * min(good):.1f}%" if good else "-"
    swap_mb = (m.swap.bytes_in + m.swap.bytes_out) / 1e6
    return [o.label, str(m.completed), str(m.failed), _num(m.ttft_ms.p50), _num(m.ttft_ms.p99),
            _num(m.tbt_ms.p99), _num(m.tpot_ms.p50), _num(m.e2e_ms.p50), slo,
            _num(m.goodput_rps, 2), _num(m.output_tokens_per_s), _num(m.be_requests_per_s, 2),
            str(m.preemptions), _num(swap_mb), _num(m.scheduler_ms_per_iteration.p50, 3),
            _num(o.wall_s)]


def table(outcomes: Sequence[RunOutcome]) -> str:
    """Latencies in ms; `SLO ok` is the lowest per-class share of requests meeting all SLOs.
    Plain text (no colour, no box), so that CI logs and tests read it as it is; a run that
    failed has dashes in its row and its error under the table."""
    grid = plain_table(COLUMNS)
    errors = []
    for o in outcomes:
        cells = row(o)
        if len(cells) != len(COLUMNS):
            errors.append(f"{o.label}: {cells[-1]}")
            cells = [o.label] + ["-"] * (len(COLUMNS) - 1)
        grid.add_row(*cells)
    return "\n".join([plain_text(grid)] + errors)
