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
    return "\n".join([plain_text(grid)] + errors + prefix_cache_lines(outcomes))


def prefix_cache_lines(outcomes: Sequence[RunOutcome]) -> list[str]:
    """A line per run whose policy turned the device prefix cache on."""
    lines = []
    for o in outcomes:
        c = o.metrics.prefix_cache if o.metrics is not None else None
        if c is not None and c.queried_tokens:
            rate = 100 * c.hit_tokens / c.queried_tokens
            lines.append(f"{o.label}: prefix cache hit {rate:.1f}% "
                         f"of tokens ({c.hit_tokens}/{c.queried_tokens}), "
                         f"{100 * c.hit_blocks / max(c.queried_blocks, 1):.1f}% of blocks "
                         f"({c.hit_blocks}/{c.queried_blocks}), {c.evicted_blocks} evicted")
    return lines


CLASS_COLUMNS = ("policy", "class", "done", "TTFT p50", "TTFT p99", "TPOT p50", "norm lat",
                 "TTFT ok", "TPOT ok", "TPOT ok/token", "TPOT ok/gap", "out tok/s", "req/s")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def class_table(outcomes: Sequence[RunOutcome]) -> str | None:
    """Each request class apart (BROS: RT latency and SLOs, BE throughput): latencies in ms,
    `norm lat` the mean end-to-end latency per output token, `TPOT ok/token` the share of
    tokens on time (the k-th by first + k x TPOT), `TPOT ok/gap` the share within TPOT of the
    token before. None when every run has a single class."""
    runs = [o for o in outcomes if o.metrics is not None]
    if not any(len(o.metrics.by_class) > 1 for o in runs):
        return None
    grid = plain_table(CLASS_COLUMNS)
    for o in runs:
        for cls, b in o.metrics.by_class.items():
            a = b["slo_attainment"]
            grid.add_row(o.label, cls, str(b["completed"]), _num(b["ttft_ms"]["p50"]),
                         _num(b["ttft_ms"]["p99"]), _num(b["tpot_ms"]["p50"]),
                         _num(b["normalized_latency_ms"]["mean"]), _pct(a["ttft"]),
                         _pct(a["tpot"]), _pct(a["tpot_per_token"]),
                         _pct(a.get("tpot_per_gap")),
                         _num(b["output_tokens_per_s"]), _num(b["requests_per_s"], 2))
    return plain_text(grid)
