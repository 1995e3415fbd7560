"""`shunter bench --sweep KEY=V1,V2,...`: every policy at every value of one workload key (a load
sweep: `rate=0.05,0.1,0.2`), so where a policy stops keeping up shows as a knee. One table, one
JSON and one plot (P99 TTFT and throughput against the key) for the whole sweep.

A run "keeps up" when its queue is not growing: the requests waiting (not in the batch) over the
last third of the arrival window average at most 1.5x (+2) what they did over its first third.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.errors import ConfigError
from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.run import RunOutcome
from shunter.workloads import Workload


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """`rate=0.1,0.2` -> ("rate", ["0.1", "0.2"])."""
    key, sep, values = text.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not items:
        raise ConfigError(f"--sweep {text!r}: expected KEY=V1,V2,... (e.g. rate=0.1,0.2,0.4)")
    return key.strip(), items


def with_key(spec: str, key: str, value: str) -> str:
    """The workload spec with `key` set to `value` (replacing it if the spec sets it)."""
    if spec.endswith(".toml"):
        raise ConfigError(f"--sweep needs a NAME:key=value spec, not a file ({spec})")
    name, _, rest = spec.partition(":")
    keys = [k for k in rest.split(",") if k and k.split("=", 1)[0].strip() != key]
    return f"{name}:{','.join([*keys, f'{key}={value}'])}"


def queue_trend(outcome: RunOutcome, workload: Workload) -> tuple[float, float]:
    """Mean queued requests over the first and the last third of the arrival window."""
    log = outcome.log
    if log is None or not len(log):
        return float("nan"), float("nan")
    t0, span = log.time[0], max(workload.duration_s, 1e-9)
    thirds: list[list[int]] = [[], []]
    for t, q in zip(log.time, log.queued):
        x = (t - t0) / span
        if x < 1 / 3:
            thirds[0].append(q)
        elif 2 / 3 <= x <= 1:
            thirds[1].append(q)
    return tuple(sum(v) / len(v) if v else float("nan") for v in thirds)  # type: ignore[return-value]


def keeps_up(first: float, last: float) -> bool:
    return not last > 1.5 * first + 2


def sweep_rows(key: str, value: str, workload: Workload,
               outcomes: Sequence[RunOutcome]) -> list[dict[str, Any]]:
    """One row per policy at one value; ratios are against the first policy at that value."""
    base = outcomes[0].metrics
    rows = []
    for o in outcomes:
        m = o.metrics
        if m is None:
            rows.append({key: value, "policy": o.label, "error": o.error})
            continue
        first, last = queue_trend(o, workload)
        row = {key: value, "policy": o.label, "ttft_p99_ms": m.ttft_ms.p99,
               "tbt_p999_ms": m.tbt_ms.p999, "output_tokens_per_s": m.output_tokens_per_s,
               "queued_first_third": first, "queued_last_third": last,
               "keeps_up": keeps_up(first, last), "duration_s": m.duration_s,
               "completed": m.completed, "failed": m.failed}
        if base is not None:
            row["vs_first"] = {
                "ttft_p99_speedup": base.ttft_ms.p99 / m.ttft_ms.p99,
                "tbt_p999_speedup": base.tbt_ms.p999 / m.tbt_ms.p999,
                "throughput_ratio": m.output_tokens_per_s / base.output_tokens_per_s}
        rows.append(row)
    return rows


def run_sweep(key: str, values: Sequence[str], spec: str, choices: Sequence[PolicyChoice],
              base: EngineConfig, *, load: Callable[[str], Workload],
              run: Callable[[Sequence[PolicyChoice], Workload, EngineConfig], list[RunOutcome]],
              ) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for value in values:
        workload = load(with_key(spec, key, value))
        rows += sweep_rows(key, value, workload, run(choices, workload, base))
    return rows


def sweep_table(key: str, rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table, one line per (value, policy)."""
    head = (f"{key:>8} {'policy':<28} {'P99 TTFT ms':>12} {'P99.9 TBT ms':>13} {'out tok/s':>10} "
            f"{'queue 1st/3rd third':>20} {'keeps up':>8} {'TTFT x':>7} {'TBT x':>7} {'tput x':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r[key]:>8} {r['policy']:<28} error: {r['error']}")
            continue
        v = r.get("vs_first", {})
        lines.append(
            f"{r[key]:>8} {r['policy']:<28} {r['ttft_p99_ms']:>12.0f} {r['tbt_p999_ms']:>13.0f} "
            f"{r['output_tokens_per_s']:>10.1f} "
            f"{r['queued_first_third']:>9.1f}/{r['queued_last_third']:<10.1f} "
            f"{'yes' if r['keeps_up'] else 'NO':>8} {v.get('ttft_p99_speedup', 0):>7.2f} "
            f"{v.get('tbt_p999_speedup', 0):>7.2f} {v.get('throughput_ratio', 0):>7.2f}")
    return "\n".join(lines)


def plot_sweep(key: str, rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """P99 TTFT (log scale) and throughput against `key`, a line per policy."""
    from shunter.benchmark.plots import _pyplot

    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy and "error" not in r]
        xs = [float(r[key]) for r in mine]
        ax1.plot(xs, [r["ttft_p99_ms"] / 1000 for r in mine], marker="o", label=policy)
        ax2.plot(xs, [r["output_tokens_per_s"] for r in mine], marker="o", label=policy)
    ax1.set(xlabel=key, ylabel="P99 TTFT (s)", yscale="log", title="P99 TTFT")
    ax2.set(xlabel=key, ylabel="output tokens/s", title="throughput")
    ax1.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
