"""The timeline of one KunServe burst from a `bench/kunserve.py` report (simulator, virtual
time): arrivals and queued tokens, KV usage per serving unit beside the cluster's demand that
the restore rule reads, each instance's group and dropped layers, and TTFT by arrival for
kunserve against vllm_dp. Grey spans: some instances grouped (layers dropped), as the paper's
Figure 16 marks them; red lines: a group formed, green: a group restored.

    python bench/kunserve_plot.py bench/results/kunserve_sim.json [more.json ...]

writes each report's plot beside it (.png). matplotlib is optional (`pip install -e
'.[plot]'`): it is imported only when a plot is drawn, and without it `plot` says so and
draws nothing. The data each panel shows is computed here without matplotlib (`segments`,
`grouped_spans`, `arrivals_per_s`, `demand_series`), so it is tested where matplotlib is
absent.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

GROUP_COLORS = ["tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"]


def segments(samples: list[dict]) -> list[list[tuple[float, float, int, int]]]:
    """Per instance, its runs of one state as (start, end, head, dropped layers): `head` is the
    instance heading its unit (itself when alone). Each run lasts until the next sample that
    differs; the last one until the last sample."""
    if not samples:
        return []
    out = []
    for i in range(len(samples[0]["group"])):
        runs: list[tuple[float, float, int, int]] = []
        start, state = samples[0]["t"], (samples[0]["group"][i], samples[0]["dropped_layers"][i])
        for s in samples[1:]:
            now = (s["group"][i], s["dropped_layers"][i])
            if now != state:
                runs.append((start, s["t"], *state))
                start, state = s["t"], now
        runs.append((start, samples[-1]["t"], *state))
        out.append(runs)
    return out


def grouped_spans(samples: list[dict]) -> list[tuple[float, float]]:
    """The spans during which some instance has dropped layers (the paper's grey boxes)."""
    spans: list[tuple[float, float]] = []
    start = None
    for s in samples:
        grouped = any(s["dropped_layers"])
        if grouped and start is None:
            start = s["t"]
        elif not grouped and start is not None:
            spans.append((start, s["t"]))
            start = None
    if start is not None:
        spans.append((start, samples[-1]["t"]))
    return spans


def arrivals_per_s(series: list, bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Request arrivals per second in bins of `bin_s` from a run's `ttft_series` ((arrival,
    TTFT) pairs, seconds from the start): (bin starts, rates)."""
    if not series:
        return [], []
    counts = [0] * (int(max(a for a, _ in series) // bin_s) + 1)
    for a, _ in series:
        counts[int(a // bin_s)] += 1
    return [k * bin_s for k in range(len(counts))], [c / bin_s for c in counts]


def demand_series(samples: list[dict]) -> tuple[list[float], list[float], bool]:
    """The cluster's memory demand over the pre-drop capacity at each sample: what the restore
    rule reads (`demand`, recorded since round 9), or, in older reports, only the KV held over
    the first sample's pools. (times, values, whether it is the restore rule's own)."""
    ts = [s["t"] for s in samples]
    if samples and all(s.get("demand") is not None for s in samples):
        return ts, [s["demand"] for s in samples], True
    capacity = sum(samples[0]["pool"]) if samples else 0
    return ts, [sum(u or 0 for u in s["used"]) / capacity if capacity else 0.0
                for s in samples], False


def restore_threshold(rule: str | None) -> float | None:
    """The share in a restore rule's `kv_usage < N%` (None without one)."""
    m = re.search(r"kv_usage\s*<\s*([0-9.]+)\s*%", rule or "")
    return float(m.group(1)) / 100 if m else None


EVENT_COLORS = {"group": "tab:red", "restore": "tab:green"}


def event_lines(events: list[dict]) -> list[tuple[float, str]]:
    """The vertical lines: red where a group formed, green where one restored. Other events
    (a fault, the torch runs' `swept` or `rescheduled`) get none: drawn as restores, they
    showed restores that never happened."""
    return [(e["t"], EVENT_COLORS[e["event"]]) for e in events if e["event"] in EVENT_COLORS]


def last_arrival(series: list) -> float | None:
    """The last arrival in a run's `ttft_series` (a window at rate 0.5x spans twice its
    duration, so the spec's `duration` is not where the arrivals end)."""
    return max((a for a, _ in series), default=None)


def plot(report: dict, path: Path) -> bool:
    """Draw the kunserve run's timeline to `path`; False (and nothing drawn) without
    matplotlib or without a kunserve run with a cluster block."""
    run = report["runs"].get("kunserve")
    if not run or not run.get("cluster"):
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no timeline plot (pip install -e '.[plot]')")
        return False
    c = run["cluster"]
    samples = c["kv_usage"]
    ts = [s["t"] for s in samples]
    n = len(samples[0]["used"])
    fig, ax = plt.subplots(4, 1, figsize=(10, 11), sharex=True,
                           gridspec_kw={"height_ratios": [2, 3, 1.2 + 0.35 * n, 3]})
    spans = grouped_spans(samples)
    for a in ax:
        for lo, hi in spans:
            a.axvspan(lo, hi, color="0.92", zorder=0)
        for t, color in event_lines(c["events"]):
            a.axvline(t, color=color, ls="--", lw=0.8)
        end = last_arrival(run.get("ttft_series") or [])
        if end is not None:
            a.axvline(end, color="k", ls=":", lw=0.8)

    xs, rates = arrivals_per_s(run.get("ttft_series") or [])
    ax[0].bar(xs, rates, width=1.0, align="edge", color="0.75", label="arrivals / s")
    ax[0].set_ylabel("arrivals / s")
    ax[0].set_ylim(bottom=0)
    q = ax[0].twinx()
    q.plot(ts, [s["queued_tokens"] / 1e3 for s in samples], color="k", lw=0.8,
           label="queued tokens (k)")
    q.set_ylabel("queued tokens (k)")
    q.set_ylim(bottom=0)
    ax[0].legend(loc="upper left", fontsize=7)
    q.legend(loc="upper right", fontsize=7)

    for i in range(n):
        ax[1].plot(ts, [(s["used"][i] or 0) / s["pool"][i] if s["pool"][i] else float("nan")
                        for s in samples], lw=0.9, label=f"instance {i}")
    dts, demand, own = demand_series(samples)
    ax[1].plot(dts, demand, color="k", lw=1.8,
               label="cluster demand / pre-drop capacity" if own
               else "cluster KV held / pre-drop capacity")
    share = restore_threshold(run.get("restore_rule"))
    if share is not None:
        ax[1].axhline(share, color="tab:green", ls=":", lw=1.2,
                      label=f"restore: {run['restore_rule']}")
    ax[1].set_ylabel("KV usage (of own pool;\na head: its group's)")
    top = max(demand, default=0) * 1.05
    ax[1].set_ylim(0, max(1.05, min(2.0, top)))
    if top > 2.0:
        ax[1].text(0.5, 0.97, f"demand clipped at 2 (peak {top / 1.05:.2f})", ha="center",
                   va="top", fontsize=7, transform=ax[1].transAxes)
    ax[1].legend(fontsize=7, loc="best")

    heads = sorted({h for runs in segments(samples) for _, _, h, d in runs if d})
    for i, runs in enumerate(segments(samples)):
        for lo, hi, head, dropped in runs:
            grouped = dropped > 0
            color = GROUP_COLORS[heads.index(head) % len(GROUP_COLORS)] if grouped else "0.85"
            ax[2].barh(i, hi - lo, left=lo, height=0.7, color=color, edgecolor="none")
            if grouped and hi - lo > 0.06 * (ts[-1] - ts[0]):
                ax[2].text((lo + hi) / 2, i, f"head {head}, -{dropped} layers", ha="center",
                           va="center", fontsize=7, color="w")
    ax[2].set_yticks(range(n), [f"instance {i}" for i in range(n)])
    ax[2].set_ylim(n - 0.5, -0.5)
    ax[2].set_ylabel("groups")

    for label, color in (("vllm_dp", "0.55"), ("kunserve", "tab:blue")):
        r = report["runs"].get(label) or {}
        series = r.get("ttft_series")
        if series:
            ax[3].scatter([a for a, _ in series], [t for _, t in series], s=3, color=color,
                          label=f"{label} (P99 {r['ttft_p99_s']:.2f} s)")
    ax[3].set_yscale("log")
    # from just before the first arrival (a trace window may start quiet) to the last sample
    first = min((a for a, _ in run.get("ttft_series") or []), default=ts[0])
    ax[3].set_xlim(max(0.0, first - 5), max(ts[-1], xs[-1] + 1 if xs else ts[-1]) + 1)
    ax[3].set_ylabel("TTFT s (by arrival)")
    ax[3].legend(fontsize=7, loc="upper left")
    ax[3].set_xlabel("seconds from the window's start (grey: layers dropped; red: group "
                     "formed, green: restored; dotted: the last arrival)")
    fig.suptitle(f"KunServe, {report['workload']}\n{report['instances']} x {report['profile']}"
                 f"; drops {c['drops']}, restores {c['restores']}; code {run.get('code')}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    args = ap.parse_args()
    for p in args.reports:
        plot(json.loads(p.read_text()), p.with_suffix(".png"))


if __name__ == "__main__":
    main()
