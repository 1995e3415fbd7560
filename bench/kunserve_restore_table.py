"""The restore rules of several `bench/kunserve_restore.py --intervals ...` runs side by side:
per window, each rule's P99 TTFT at each monitor interval; then, over every (window, interval)
cell, each rule against the best rule of that cell (virtual time, the same arrivals per cell).

    python bench/kunserve_restore_table.py bench/results/kunserve_restore_round8_*.json \
        --out bench/results/kunserve_restore_round8_tables.md
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def cells(report: dict) -> dict[str, dict[int, dict]]:
    """{rule: {interval ms: run}} of one restore report."""
    out: dict[str, dict[int, dict]] = {}
    for key, run in report["runs"].items():
        rule = run.get("rule", key.split(" @ ")[0])
        out.setdefault(rule, {})[run.get("interval_ms", 50)] = run
    return out


def restores(run: dict) -> int:
    return sum(1 for _, event, _ in run["events"] if event == "restore")


def window_table(name: str, report: dict) -> list[str]:
    by_rule = cells(report)
    intervals = sorted({ms for runs in by_rule.values() for ms in runs})
    lines = [f"### {name}: {report['workload']}", "",
             "| restore when | " + " | ".join(f"P99 TTFT @ {ms} ms" for ms in intervals)
             + " | P50 TTFT | P50 / P99 TPOT ms | restores |",
             "|---|" + "---|" * (len(intervals) + 3)]
    for rule, runs in by_rule.items():
        mid = runs.get(50) or next(iter(runs.values()))
        lines.append(
            f"| {rule} | " + " | ".join(f"{runs[ms]['ttft_p99_s']:.2f} s" if ms in runs else "-"
                                        for ms in intervals)
            + f" | {mid['ttft_p50_s']:.2f} s | {mid['tpot_p50_ms']:.1f} / "
              f"{mid['tpot_p99_ms']:.1f} | "
            + "/".join(str(restores(runs[ms])) for ms in intervals if ms in runs) + " |")
    return lines + [""]


def summary(reports: dict[str, dict]) -> list[str]:
    """Each rule over the cells every rule ran: geometric mean and worst of its P99 TTFT over
    the cell's best, and in how many cells it is within 2% of the best."""
    ratios: dict[str, list[float]] = {}
    for report in reports.values():
        by_rule = cells(report)
        shared = set.intersection(*(set(runs) for runs in by_rule.values()))
        for ms in sorted(shared):
            best = min(runs[ms]["ttft_p99_s"] for runs in by_rule.values())
            for rule, runs in by_rule.items():
                ratios.setdefault(rule, []).append(runs[ms]["ttft_p99_s"] / best)
    lines = ["### Over every (window, interval) cell", "",
             "| restore when | cells | P99 TTFT / cell's best: geometric mean | worst | "
             "within 2% of best |", "|---|---|---|---|---|"]
    for rule, rs in sorted(ratios.items(), key=lambda kv: sum(map(math.log, kv[1]))):
        gm = math.exp(sum(map(math.log, rs)) / len(rs))
        lines.append(f"| {rule} | {len(rs)} | {gm:.3f} | {max(rs):.3f} | "
                     f"{sum(r <= 1.02 for r in rs)} |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    reports = {p.stem: json.loads(p.read_text()) for p in args.reports}
    lines: list[str] = []
    for name, report in reports.items():
        lines += window_table(name, report)
    lines += summary(reports)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
