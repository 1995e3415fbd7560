"""PNG plots of a bench run: latency CDFs per policy, and KV usage, queue length and TTFT over
time. matplotlib is optional (`pip install 'shunter[plot]'`) and imported only here."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import ShunterError
from engine.metrics import request_metrics
from shunter.benchmark.run import RunOutcome


class PlotError(ShunterError):
    """Plots were asked for but cannot be drawn (matplotlib is missing)."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("--plot needs matplotlib, which is not installed: "
                        "pip install 'shunter[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require_matplotlib() -> None:
    """Fail before a long run rather than after it."""
    _pyplot()


def _cdf(ax, values: Sequence[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    n = len(xs)
    step = max(1, n // 2000)  # a few thousand points draw the same curve as millions
    pts = xs[::step] + [xs[-1]]
    ax.plot(pts, [min(1.0, i * step / n) for i in range(len(pts) - 1)] + [1.0], label=label)


def plot_title(workload: str, config: EngineConfig) -> str:
    """What every plot is of: the workload, the backend, and its profile (sim) or model."""
    where = (f"profile {config.profile}" if config.backend == "sim"
             else f"model {Path(config.model).name}")
    return f"workload {workload}, backend {config.backend}, {where}"


def write_plots(outcomes: Sequence[RunOutcome], out_dir: Path, title: str = "") -> list[Path]:
    """Write latency_cdf.png and timeline.png, each headed by `title`; returns their paths."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = [o for o in outcomes if o.metrics is not None]
    per = {o.label: [request_metrics(t, o.drive.goals.get(t.request_id)) for t in o.drive.timelines]
           for o in ok}

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, ms in per.items():
        done = [m for m in ms if m.completed]
        _cdf(axes[0], [m.ttft_ms for m in done if m.ttft_ms is not None], label)
        _cdf(axes[1], [g for m in done for g in m.tbt_ms], label)
        _cdf(axes[2], [m.e2e_ms for m in done], label)
    for ax, title in zip(axes, ("TTFT (ms)", "time between tokens (ms)", "end-to-end latency (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests" if ax is not axes[1] else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    cdf_path = out_dir / "latency_cdf.png"
    fig.savefig(cdf_path, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    for o in ok:
        log, t0 = o.log, o.drive.started
        if log is not None and len(log):
            step = max(1, len(log) // 3000)
            ts = [log.time[i] - t0 for i in range(0, len(log), step)]
            usage = log.kv_usage()
            axes[0].plot(ts, [100 * usage[i] for i in range(0, len(log), step)], label=o.label, lw=0.8)
            axes[1].plot(ts, [log.queued[i] for i in range(0, len(log), step)], label=o.label, lw=0.8)
        pts = sorted((t.token_times[0] - t0, (t.token_times[0] - t.arrival) * 1000.0)
                     for t in o.drive.timelines if t.token_times)
        if pts:
            axes[2].plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=2, label=o.label)
    axes[0].set_ylabel("KV blocks in use (%)")
    axes[1].set_ylabel("requests queued")
    axes[2].set_ylabel("TTFT (ms)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("engine clock since the first arrival (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    time_path = out_dir / "timeline.png"
    fig.savefig(time_path, dpi=110)
    plt.close(fig)
    return [cdf_path, time_path]
