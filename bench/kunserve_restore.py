"""KunServe's restore rule varied on the same arrivals (simulator, virtual time): the §4.4
threshold against the pre-drop capacity alone, with the queue drained, with a hold of N monitor
rounds or of N seconds of the monitor's clock (hysteresis), lower thresholds; and no restore
(kunserve_lookahead). Each variant is
kunserve_lookahead plus one `overload restore when ...` rule; the one policies/kunserve.policy
ships is marked "(kunserve)". `--intervals 40,50,60` runs each variant at each monitor interval
(ms; the spread a rule's P99 has over the monitor's phase).

    python bench/kunserve_restore.py --trace azure-conv --start 1560 --duration 90 --rate 0.95x \
        --out bench/results/kunserve_restore_conv_095x

Writes the P50/P99 TTFT, P50/P99 TPOT and the group/restore events of each variant to
<out>.json and a table to <out>.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kunserve_trace import (
    add_trace_args,
    policy_dir,
    run_row,
    sim_instance,
    trace_workload,
)
from policies import policy_path

RULES = {
    "kv_usage < 50%": "kv_usage < 50%",
    "and waiting == 0": "kv_usage < 50% and waiting == 0",
    "for 20 iterations": "kv_usage < 50% for 20 iterations",
    "for 40 iterations": "kv_usage < 50% for 40 iterations",
    "for 100 iterations": "kv_usage < 50% for 100 iterations",
    "for 1s": "kv_usage < 50% for 1s",
    "for 2s": "kv_usage < 50% for 2s",
    "for 3s": "kv_usage < 50% for 3s",
    "for 4s": "kv_usage < 50% for 4s",
    "for 6s": "kv_usage < 50% for 6s",
    "kv_usage < 40%": "kv_usage < 40%",
    "40% for 4s": "kv_usage < 40% for 4s",
}


def shipped_rule() -> str:
    """The restore rule policies/kunserve.policy ships (its `overload restore when` line)."""
    text = Path(policy_path("kunserve")).read_text()
    return next(line.split("overload restore when", 1)[1].strip() for line in text.splitlines()
                if line.strip().startswith("overload restore when"))


NEVER = "never (kunserve_lookahead)"  # the variant without a restore rule
VARIANTS = {(f"{k} (kunserve)" if v == shipped_rule() else k): v for k, v in RULES.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_args(ap, rate="0.95x")
    ap.add_argument("--only", default="", help="comma-separated variant names, without the "
                    "'(kunserve)' mark (default: all)")
    ap.add_argument("--intervals", default="50", help="monitor intervals, ms, comma-separated")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kunserve_restore"))
    args = ap.parse_args()
    names = [NEVER, *(k.removesuffix(" (kunserve)") for k in VARIANTS)]
    unknown = [x for x in args.only.split(",") if x and x not in names] if args.only else []
    if unknown:  # (before: nothing ran and an empty report was written)
        ap.error(f"--only: no variant named {', '.join(map(repr, unknown))} "
                 f"(variants: {', '.join(map(repr, names))})")
    spec, workload = trace_workload(args)
    base = sim_instance()
    out = Path(args.out)
    policies = policy_dir(out)
    runs = [(NEVER, Path(policy_path("kunserve_lookahead")))]
    keep = set(args.only.split(",")) if args.only else None
    intervals = [int(ms) for ms in args.intervals.split(",")]
    for k, (name, rule) in enumerate(VARIANTS.items()):
        path = policies / f"restore_variant_{k}.policy"
        text = (f'policy restore_variant_{k} extends "{policy_path("kunserve_lookahead")}"'
                f' {{\n  overload restore when {rule}\n}}\n')
        if not path.exists() or path.read_text() != text:  # (benches running side by side)
            path.write_text(text)
        runs.append((name, path))
    report = {"workload": spec, "shipped": shipped_rule(), "intervals_ms": intervals,
              "runs": {}}
    import bench.kunserve as bench  # (its monitor interval)

    for name, path in runs:
        if keep is not None and name.removesuffix(" (kunserve)") not in keep:
            continue
        for ms in intervals:
            bench.MONITOR_INTERVAL_S = ms / 1000
            key = name if len(intervals) == 1 else f"{name} @ {ms} ms"
            s = report["runs"][key] = run_row("kunserve", path, workload, base) | {
                "rule": name, "interval_ms": ms}
            print(f"{key}: P99 TTFT {s['ttft_p99_s']:.3f} s, P50 TPOT {s['tpot_p50_ms']:.1f} "
                  f"ms, events {s['events']}", flush=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"# KunServe restore rule varied: {spec}, 4 x llama3-8b-a10", "",
             ("| restore when | P50 TTFT s | P99 TTFT s | P50 TPOT ms | P99 TPOT ms | "
              "groups (g) and restores (r), s |"), "|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        ev = ", ".join(f"{t}{e[0]}" for t, e, _ in r["events"])
        lines.append(f"| {name} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                     f"{r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | {ev} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
