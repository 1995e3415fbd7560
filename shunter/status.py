"""What the REPL's `status` and `GET /admin/stats` show: the scheduler's queues, preemptions and
overload triggers, and per-class latency and SLO attainment of the requests finished since the
running policy was loaded (BROS §7.1: TTFT and TPOT attainment counted separately). One `Status`,
rendered as text or JSON; the REPL over HTTP renders the JSON it reads back."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs

from engine.metrics import Percentiles
from engine.snapshots import SchedulerSnapshot
from engine.timeline import RequestTimeline
from shunter.plain_text import plain_table, plain_text


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


CLASS_COLUMNS = ("class", "done", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "TTFT met",
                 "TPOT met")


def table(rows: Sequence[ClassStats]) -> str:
    """One row per class (latencies in ms), indented under the "since ... was loaded" line."""
    grid = plain_table(CLASS_COLUMNS)
    for r in rows:
        grid.add_row(r.label, str(r.done), _ms(r.ttft_ms.p50), _ms(r.ttft_ms.p99),
                     _ms(r.tpot_ms.p50), _ms(r.tpot_ms.p99), _share(r.ttft_met),
                     _share(r.tpot_met))
    return "\n".join("  " + line for line in plain_text(grid).splitlines())


@attrs.frozen(kw_only=True)
class Status:
    scheduler: SchedulerSnapshot
    running_s: float
    """How long the running policy has run (wall seconds)."""
    classes: tuple[ClassStats, ...]
    """Requests finished since the running policy was loaded, per class."""

    def head(self) -> list[str]:
        s = self.scheduler
        return [
            f"policy {s.policy} v{s.policy_version} for {self.running_s:.0f} s; "
            f"iteration {s.iteration}, last one {s.iteration_ms:.1f} ms",
            f"queues: {s.waiting} waiting, {s.running} running, {s.swapped} swapped, "
            f"{s.swapping_in} swapping in; {s.free_blocks} of {s.total_blocks} KV blocks free; "
            f"{s.preemptions} preemptions",
            f"overload: {s.overload or 'none'} (drop fired {s.overload_drops} times, restore "
            f"{s.overload_restores})",
        ]

    def tail(self) -> list[str]:
        s = self.scheduler
        return [f"since {s.policy} v{s.policy_version} was loaded (latencies in ms):",
                table(self.classes)]

    def as_json(self) -> dict:
        return {"scheduler": attrs.asdict(self.scheduler), "running_s": self.running_s,
                "classes": [_class_json(c) for c in self.classes]}

    @classmethod
    def from_json(cls, data: dict) -> Status:
        sched = dict(data["scheduler"], live_requests=tuple(data["scheduler"]["live_requests"]))
        return cls(scheduler=SchedulerSnapshot(**sched), running_s=data["running_s"],
                   classes=tuple(_class_from_json(c) for c in data["classes"]))


def _class_json(c: ClassStats) -> dict:
    def pct(p: Percentiles) -> dict:
        # JSON has no NaN: a class with no samples has nulls
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in attrs.asdict(p).items()}

    return {"label": c.label, "done": c.done, "ttft_ms": pct(c.ttft_ms), "tpot_ms": pct(c.tpot_ms),
            "ttft_met": c.ttft_met, "tpot_met": c.tpot_met}


def _class_from_json(d: dict) -> ClassStats:
    def pct(p: dict) -> Percentiles:
        return Percentiles(**{k: (math.nan if v is None else v) for k, v in p.items()})

    return ClassStats(label=d["label"], done=d["done"], ttft_ms=pct(d["ttft_ms"]),
                      tpot_ms=pct(d["tpot_ms"]), ttft_met=d["ttft_met"], tpot_met=d["tpot_met"])
