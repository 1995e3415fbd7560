"""Per-class latency and SLO attainment of the REPL workload's finished requests (BROS §7.1:
TTFT and TPOT attainment counted separately)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs

from engine.metrics import Percentiles
from engine.timeline import RequestTimeline


@attrs.frozen(kw_only=True)
class ClassStats:
    label: str
    done: int
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    ttft_met: float | None
    """Share of requests with a TTFT deadline that met it; None when none had one."""
    tpot_met: float | None


def _met(pairs: Iterable[tuple[float | None, float | None]]) -> float | None:
    judged = [value <= slo for value, slo in pairs if value is not None and slo is not None]
    return sum(judged) / len(judged) if judged else None


def class_stats(label: str, timelines: Sequence[RequestTimeline]) -> ClassStats:
    ok = [t for t in timelines if t.finish_reason != "error"]
    ttft = [t.ttft_s * 1000.0 for t in ok if t.ttft_s is not None]
    tpot = [t.tpot_s * 1000.0 for t in ok if t.tpot_s is not None]
    return ClassStats(
        label=label, done=len(ok), ttft_ms=Percentiles.of(ttft), tpot_ms=Percentiles.of(tpot),
        ttft_met=_met((None if t.ttft_s is None else t.ttft_s * 1000.0, t.ttft_slo_ms) for t in ok),
        tpot_met=_met((None if t.tpot_s is None else t.tpot_s * 1000.0, t.tpot_slo_ms) for t in ok))


def _ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.1f}"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100.0 * v:.1f}%"


def table(rows: Sequence[ClassStats]) -> str:
    head = (f"  {'class':<6}{'done':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'TPOT p99':>10}{'TTFT met':>10}{'TPOT met':>10}")
    lines = [head, "  " + " " * 6 + f"{'':>6}{'ms':>10}{'ms':>10}{'ms':>10}{'ms':>10}"]
    for r in rows:
        lines.append(f"  {r.label:<6}{r.done:>6}{_ms(r.ttft_ms.p50):>10}{_ms(r.ttft_ms.p99):>10}"
                     f"{_ms(r.tpot_ms.p50):>10}{_ms(r.tpot_ms.p99):>10}{_share(r.ttft_met):>10}"
                     f"{_share(r.tpot_met):>10}")
    return "\n".join(lines)
