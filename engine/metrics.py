"""Latency and throughput aggregates computed from request timelines.

One module used by the demo, `shunter bench`, the REPL and `/metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs

from engine.timeline import RequestTimeline


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of unsorted values; nan when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@attrs.frozen(kw_only=True)
class Percentiles:
    p50: float
    p90: float
    p95: float
    p99: float
    p999: float
    mean: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        mean = sum(values) / len(values) if values else math.nan
        return cls(p50=percentile(values, 50), p90=percentile(values, 90),
                   p95=percentile(values, 95), p99=percentile(values, 99),
                   p999=percentile(values, 99.9), mean=mean, count=len(values))

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in attrs.asdict(self).items() if k != "count"}


@attrs.frozen(kw_only=True)
class Summary:
    requests: int
    output_tokens: int
    ttft_ms: Percentiles
    tbt_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles


def _ms(values: Iterable[float | None]) -> list[float]:
    return [v * 1000.0 for v in values if v is not None]


def summarize(timelines: Sequence[RequestTimeline], *, duration_s: float) -> Summary:
    done = [t for t in timelines if t.finish_reason != "error"]
    return Summary(
        requests=len(done),
        output_tokens=sum(t.output_tokens for t in done),
        ttft_ms=Percentiles.of(_ms(t.ttft_s for t in done)),
        tbt_ms=Percentiles.of(_ms(g for t in done for g in t.tbt_s)),
        tpot_ms=Percentiles.of(_ms(t.tpot_s for t in done)),
        e2e_ms=Percentiles.of(_ms(t.e2e_s for t in done)),
    )
