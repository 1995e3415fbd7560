"""Latency and throughput aggregates computed from request timelines.

One module used by the demo, `shunter bench`, the REPL and `/metrics`. Per request
(`RequestMetrics`): TTFT, every inter-token gap (TBT), TPOT, end-to-end and normalized latency,
queueing time, preemptions, swap-in stall, and which SLOs it met. Per run (`RunMetrics`):
percentiles of each, SLO attainment per class, goodput, throughput, preemptions, swap volume and
scheduler time per iteration.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from engine.cost_model_error import prediction_error
from engine.iteration_log import IterationLog, PrefixCacheCounters, SwapCounters
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
        """Sorts once (a replayed hour has millions of token gaps); same interpolation as
        `percentile`."""
        if len(values) == 0:
            nan = math.nan
            return cls(p50=nan, p90=nan, p95=nan, p99=nan, p999=nan, mean=nan, count=0)
        a = np.asarray(values, dtype=np.float64)
        q = np.percentile(a, [50, 90, 95, 99, 99.9])
        return cls(p50=float(q[0]), p90=float(q[1]), p95=float(q[2]), p99=float(q[3]),
                   p999=float(q[4]), mean=float(a.mean()), count=len(a))

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


# ------------------------------------------------------------------------ per request


@attrs.frozen(kw_only=True)
class Goal:
    """How a benchmark judges one request: its class label and SLOs (None: no such SLO)."""

    request_class: str
    ttft_ms: float | None = None
    tpot_ms: float | None = None


@attrs.frozen(kw_only=True)
class RequestMetrics:
    request_class: str
    completed: bool
    """Ended by `stop` or `length` (not an error or a cancellation)."""
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float | None
    tbt_ms: tuple[float, ...]
    tpot_ms: float | None
    e2e_ms: float
    normalized_latency_ms: float | None
    """End-to-end latency per output token (Orca, vLLM, BROS §7.1)."""
    queue_ms: float | None
    preemptions: int
    swap_stall_ms: float
    met_ttft: bool | None
    """None when the request has no TTFT SLO."""
    met_tpot: bool | None
    tpot_tokens: int = 0
    """Output tokens after the first, when the request has a TPOT SLO."""
    tpot_tokens_met: int = 0
    """Of those, tokens delivered by their own deadline, the k-th at first + k * TPOT (BROS's
    fine-grained SLO: attainment counted per token, not per request)."""
    tpot_gaps_met: int = 0
    """Of `tpot_tokens`, tokens delivered within TPOT of the token before (BROS §4.1's
    constraint times each token from the last one returned). A stall after tokens that came
    early misses here, where the cumulative count above can absorb it."""

    @property
    def good(self) -> bool:
        """Completed and met every SLO it has (goodput counts these)."""
        return self.completed and self.met_ttft is not False and self.met_tpot is not False


def request_metrics(t: RequestTimeline, goal: Goal | None = None) -> RequestMetrics:
    """One request's numbers; `goal` overrides the class and SLOs the timeline carries."""
    goal = goal or Goal(request_class=t.request_class, ttft_ms=t.ttft_slo_ms, tpot_ms=t.tpot_slo_ms)
    completed = t.finish_reason in ("stop", "length", "context", "pool")
    ttft = None if t.ttft_s is None else t.ttft_s * 1000.0
    tpot = None if t.tpot_s is None else t.tpot_s * 1000.0
    e2e = t.e2e_s * 1000.0
    met_ttft = met_tpot = None
    per_token = per_token_met = gaps_met = 0
    if goal.tpot_ms is not None and len(t.token_times) > 1:
        first, step = t.token_times[0], goal.tpot_ms / 1000.0
        per_token = len(t.token_times) - 1
        per_token_met = sum(at <= first + k * step + 1e-9
                            for k, at in enumerate(t.token_times[1:], start=1))
        gaps_met = sum(b - a <= step + 1e-9 for a, b in zip(t.token_times, t.token_times[1:]))
    if goal.ttft_ms is not None:
        met_ttft = completed and ttft is not None and ttft <= goal.ttft_ms
    if goal.tpot_ms is not None:
        # a single-token answer has no TPOT and cannot miss it
        met_tpot = completed and (tpot is None or tpot <= goal.tpot_ms)
    return RequestMetrics(
        request_class=goal.request_class, completed=completed, prompt_tokens=t.prompt_tokens,
        output_tokens=t.output_tokens, ttft_ms=ttft, tbt_ms=tuple(g * 1000.0 for g in t.tbt_s),
        tpot_ms=tpot, e2e_ms=e2e,
        normalized_latency_ms=e2e / t.output_tokens if t.output_tokens else None,
        queue_ms=None if t.queue_s is None else t.queue_s * 1000.0,
        preemptions=t.preemptions, swap_stall_ms=t.swap_stall_s * 1000.0,
        met_ttft=met_ttft, met_tpot=met_tpot, tpot_tokens=per_token,
        tpot_tokens_met=per_token_met, tpot_gaps_met=gaps_met)


def _failed(goal: Goal) -> RequestMetrics:
    return RequestMetrics(
        request_class=goal.request_class, completed=False, prompt_tokens=0, output_tokens=0,
        ttft_ms=None, tbt_ms=(), tpot_ms=None, e2e_ms=0.0, normalized_latency_ms=None,
        queue_ms=None, preemptions=0, swap_stall_ms=0.0,
        met_ttft=False if goal.ttft_ms is not None else None,
        met_tpot=False if goal.tpot_ms is not None else None)


# ------------------------------------------------------------------------ per run


@attrs.frozen(kw_only=True)
class Attainment:
    """Share of a class's requests (with that SLO) that met it; None when none has it."""

    requests: int
    ttft: float | None
    tpot: float | None
    all: float | None
    """Met every SLO it has (a failed request meets none)."""
    tpot_per_token: float | None = None
    """Share of output tokens (after each request's first) delivered by their deadline."""
    tpot_per_gap: float | None = None
    """Share of those tokens delivered within TPOT of the token before."""


@attrs.frozen(kw_only=True)
class RunMetrics:
    duration_s: float
    completed: int
    failed: int
    ttft_ms: Percentiles
    tbt_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles
    normalized_latency_ms: Percentiles
    queue_ms: Percentiles
    slo_attainment: Mapping[str, Attainment]
    goodput_rps: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    be_requests_per_s: float
    preemptions: int
    swap: SwapCounters
    swap_stall_ms: Percentiles
    """Per request, over the requests that stalled at all."""
    scheduler_ms_per_iteration: Percentiles
    iterations: int
    by_class: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    """The same latency and throughput blocks per request class (RT and BE apart)."""
    scheduler_share: float | None = None
    """Scheduler time as a share of iteration time (BROS §7.4.2 reports 7.6-9.5%)."""
    cost_model_error: Mapping[str, float] | None = None
    """How far the policy's predicted iteration times were from the measured ones."""
    prefix_cache: PrefixCacheCounters = attrs.field(factory=PrefixCacheCounters)
    """Device prefix cache lookups and hits (zeros unless the policy turns it on)."""

    def as_dict(self) -> dict[str, Any]:
        """The bench JSON's `metrics` object."""
        s = self.swap
        return {
            "ttft_ms": self.ttft_ms.as_dict(), "tbt_ms": self.tbt_ms.as_dict(),
            "tpot_ms": self.tpot_ms.as_dict(), "e2e_ms": self.e2e_ms.as_dict(),
            "normalized_latency_ms": self.normalized_latency_ms.as_dict(),
            "queue_ms": self.queue_ms.as_dict(),
            "slo_attainment": {c: attrs.asdict(a) for c, a in self.slo_attainment.items()},
            "goodput_rps": self.goodput_rps, "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "be_requests_per_s": self.be_requests_per_s, "preemptions": self.preemptions,
            "swap": {"copy_ops": s.copy_ops, "bytes_out": s.bytes_out, "bytes_in": s.bytes_in,
                     "avg_copy_bytes": (s.bytes_out + s.bytes_in) / s.copy_ops if s.copy_ops else 0.0,
                     "blocks_out": s.blocks_out, "blocks_in": s.blocks_in,
                     "copy_ops_per_block": (s.copy_ops / (s.blocks_out + s.blocks_in)
                                            if s.blocks_out + s.blocks_in else 0.0),
                     "blocks_per_copy": ((s.blocks_out + s.blocks_in) / s.copy_ops
                                         if s.copy_ops else 0.0),
                     "runs": s.runs, "yields": s.yields,
                     "step_copy_wait_ms": s.step_copy_wait_s * 1000.0,
                     "reused_blocks": s.reused_blocks, "turn_prefix_blocks": s.turn_prefix_blocks,
                     "turn_end_blocks_out": s.turn_end_blocks_out,
                     "sync_swap_ins": s.sync_swap_ins, "async_swap_ins": s.async_swap_ins,
                     "stall_ms": s.stall_s * 1000.0,
                     "request_stall_ms": self.swap_stall_ms.as_dict()},
            "scheduler_ms_per_iteration": self.scheduler_ms_per_iteration.as_dict(),
            "iterations": self.iterations, "duration_s": self.duration_s,
            "requests": {"completed": self.completed, "failed": self.failed},
            "by_class": dict(self.by_class), "scheduler_share": self.scheduler_share,
            "cost_model_error": self.cost_model_error,
            "prefix_cache": self.prefix_cache.as_dict(),
        }


def attainment(per_request: Sequence[RequestMetrics]) -> dict[str, Attainment]:
    by_class: dict[str, list[RequestMetrics]] = {}
    for m in per_request:
        by_class.setdefault(m.request_class, []).append(m)

    def share(flags: list[bool]) -> float | None:
        return sum(flags) / len(flags) if flags else None

    out = {}
    for cls, ms in sorted(by_class.items()):
        with_slo = [m for m in ms if m.met_ttft is not None or m.met_tpot is not None]
        out[cls] = Attainment(
            requests=len(ms),
            ttft=share([m.met_ttft for m in ms if m.met_ttft is not None]),
            tpot=share([m.met_tpot for m in ms if m.met_tpot is not None]),
            all=share([m.good for m in with_slo]),
            tpot_per_token=(sum(m.tpot_tokens_met for m in ms) / tokens
                            if (tokens := sum(m.tpot_tokens for m in ms)) else None),
            tpot_per_gap=(sum(m.tpot_gaps_met for m in ms) / tokens if tokens else None))
    return out


def run_metrics(timelines: Sequence[RequestTimeline], *, duration_s: float,
                goals: Mapping[int, Goal] | None = None, failed: Sequence[Goal] = (),
                log: IterationLog | None = None, be_class: str = "be") -> RunMetrics:
    """Aggregate a run. `goals` maps request id -> how to judge it (default: what the timeline
    says); `failed` are requests that never got a timeline (refused at admission, or failed):
    they count as failed and as missing every SLO they had."""
    goals = goals or {}
    per = [request_metrics(t, goals.get(t.request_id)) for t in timelines]
    per += [_failed(g) for g in failed]
    done = [m for m in per if m.completed]
    dur = duration_s if duration_s > 0 else math.nan
    swap = log.swap if log is not None else SwapCounters()
    return RunMetrics(
        duration_s=duration_s, completed=len(done), failed=len(per) - len(done),
        ttft_ms=Percentiles.of([m.ttft_ms for m in done if m.ttft_ms is not None]),
        tbt_ms=Percentiles.of([g for m in done for g in m.tbt_ms]),
        tpot_ms=Percentiles.of([m.tpot_ms for m in done if m.tpot_ms is not None]),
        e2e_ms=Percentiles.of([m.e2e_ms for m in done]),
        normalized_latency_ms=Percentiles.of(
            [m.normalized_latency_ms for m in done if m.normalized_latency_ms is not None]),
        queue_ms=Percentiles.of([m.queue_ms for m in done if m.queue_ms is not None]),
        slo_attainment=attainment(per),
        goodput_rps=sum(m.good for m in per) / dur,
        requests_per_s=len(done) / dur,
        output_tokens_per_s=sum(m.output_tokens for m in done) / dur,
        total_tokens_per_s=sum(m.output_tokens + m.prompt_tokens for m in done) / dur,
        be_requests_per_s=sum(m.request_class == be_class for m in done) / dur,
        preemptions=log.preemptions if log is not None else sum(m.preemptions for m in per),
        swap=swap,
        swap_stall_ms=Percentiles.of([m.swap_stall_ms for m in per if m.swap_stall_ms > 0]),
        scheduler_ms_per_iteration=Percentiles.of(
            [s * 1000.0 for s in log.scheduler_s] if log is not None else []),
        iterations=len(log) if log is not None else 0,
        by_class=class_blocks(per, dur),
        scheduler_share=scheduler_share(log),
        cost_model_error=prediction_error(log),
        prefix_cache=log.prefix if log is not None else PrefixCacheCounters(),
    )


def class_blocks(per: Sequence[RequestMetrics], dur: float) -> dict[str, dict[str, Any]]:
    """Per class: latency percentiles, normalized latency, attainment and throughput."""
    out: dict[str, dict[str, Any]] = {}
    for cls in sorted({m.request_class for m in per}):
        ms = [m for m in per if m.request_class == cls]
        done = [m for m in ms if m.completed]
        out[cls] = {
            "completed": len(done), "failed": len(ms) - len(done),
            "ttft_ms": Percentiles.of([m.ttft_ms for m in done if m.ttft_ms is not None]).as_dict(),
            "tpot_ms": Percentiles.of([m.tpot_ms for m in done if m.tpot_ms is not None]).as_dict(),
            "tbt_ms": Percentiles.of([g for m in done for g in m.tbt_ms]).as_dict(),
            "e2e_ms": Percentiles.of([m.e2e_ms for m in done]).as_dict(),
            "normalized_latency_ms": Percentiles.of(
                [m.normalized_latency_ms for m in done
                 if m.normalized_latency_ms is not None]).as_dict(),
            "slo_attainment": attrs.asdict(attainment(ms)[cls]),
            "requests_per_s": len(done) / dur,
            "output_tokens_per_s": sum(m.output_tokens for m in done) / dur,
        }
    return out


def scheduler_share(log: IterationLog | None) -> float | None:
    """Scheduler time over the time between consecutive iterations' starts (idle gaps, when
    nothing ran, left out)."""
    if log is None or len(log) < 2:
        return None
    busy = sched = 0.0
    for i in range(len(log) - 1):
        gap = log.time[i + 1] - log.time[i]
        if log.batch_seqs[i] and gap > 0:
            busy += gap
            sched += log.scheduler_s[i]
    return sched / busy if busy else None
