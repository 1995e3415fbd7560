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

`--modes` runs the shipped `kunserve` policy with each of its restore settings instead
(`memory { restore_prefetch on|off; restore_from peer|host }`, shunter/cluster/sim_restore.py),
on the same arrivals, and adds each run's restore stall (virtual seconds the heads' first steps
alone waited for a one-step restore's copies) and restores' bytes and durations;
`--link-scale` / `--host-scale` multiply the pipeline link's and the host link's bandwidth (the
sensitivity to a link speed off by 2x: 0.5):

    python bench/kunserve_restore.py --trace azure-conv --start 1560 --duration 90 --rate 0.95x \
        --modes --link-scale 0.5 --host-scale 0.5 --out bench/results/kunserve_restore_round11_x
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
    ap.add_argument("--modes", action="store_true", help="the shipped policy under each restore "
                    "setting (prefetch on/off x from peer/host), not the restore rules")
    ap.add_argument("--link-scale", type=float, default=1.0, help="pipeline link bandwidth x")
    ap.add_argument("--host-scale", type=float, default=1.0, help="host link bandwidth x")
    args = ap.parse_args()
    if args.modes:
        return run_modes(args)
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


MODES = {"prefetch on, from peers (kunserve)": ("on", "peer"),
         "prefetch off, from peers": ("off", "peer"),
         "prefetch on, from the host": ("on", "host"),
         "prefetch off, from the host": ("off", "host")}


def run_modes(args) -> None:
    """The shipped policy under each restore setting, on the same arrivals (`--modes`)."""
    import attrs

    import bench.kunserve as bench
    from shunter.cluster.groups import SimGroups
    from sim.network import LINKS

    spec, workload = trace_workload(args)
    base = sim_instance()
    link = LINKS[base.pipeline_link]
    LINKS[base.pipeline_link] = attrs.evolve(link, bytes_per_s=link.bytes_per_s * args.link_scale)
    host_link = SimGroups.host_link  # this process only: every run sees the same host link
    SimGroups.host_link = lambda self: attrs.evolve(
        host_link(self), bytes_per_s=self.host_bytes_per_s * args.host_scale)
    out = Path(args.out)
    report = {"workload": spec, "pipeline_link_gb_per_s": LINKS[base.pipeline_link].bytes_per_s
              / 1e9, "link_scale": args.link_scale, "host_scale": args.host_scale, "runs": {}}
    for name, (prefetch, source) in MODES.items():
        path = policy_dir(out) / f"restore_{prefetch}_{source}.policy"
        text = (f'policy restore_{prefetch}_{source} extends "{policy_path("kunserve")}" {{\n'
                f'  memory {{ restore_prefetch {prefetch}; restore_from {source} }}\n}}\n')
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        result, cluster, _, wall = bench.run("kunserve", path, workload, base, 4)
        s = bench.summarize(result, None)
        restores = [e for e in cluster["events"] if e["event"] == "restore"]
        gaps = [max(b - a for a, b in zip(t.token_times, t.token_times[1:]))
                for t in result.timelines if len(t.token_times) > 1]  # a stall shows here
        report["runs"][name] = {k: s[k] for k in (
            "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "requests", "failed",
            "finish_reasons")} | {
            "gap_p99_ms": bench.pct(gaps, 99) * 1e3, "gap_max_ms": max(gaps) * 1e3,
            "restore_stall_s": cluster["restore_stall_s"], "restores": len(restores),
            "groups": cluster["groups_formed"], "restore_retries": cluster["restore_retries"],
            "restore_s": [round(e["restore_s"], 4) for e in restores],
            "modelled_stall_s": [round(e["stall_s"], 4) for e in restores],
            "restored_gb": [round(e["copied_bytes"] / 1e9, 3) for e in restores],
            "kv_mb_before": [round(e.get("kv_bytes_before", 0) / 1e6, 1) for e in restores],
            "kv_mb_at": [round(e.get("kv_bytes_at", e["kv_bytes"]) / 1e6, 1) for e in restores],
            "weight_gb_at": [round(e.get("weight_bytes_at", 0) / 1e9, 3) for e in restores],
            "events": [[round(e["t"], 1), e["event"], e["members"]] for e in cluster["events"]],
            "wall_s": wall, "code": bench.code_version()}
        r = report["runs"][name]
        print(f"{name}: P99 TTFT {r['ttft_p99_s']:.3f} s, P99 TPOT {r['tpot_p99_ms']:.1f} ms, "
              f"stall {r['restore_stall_s']:.3f} s, restores {r['restores']}", flush=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"# KunServe restore settings: {spec}, 4 x llama3-8b-a10, links x"
             f"{args.link_scale:g} (pipeline) x{args.host_scale:g} (host)", "",
             "| restore | P50 TTFT s | P99 TTFT s | P50 TPOT ms | P99 TPOT ms | longest token gap "
             "P99 / max ms | restores | stall s (sum) | restore s (each) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        lines.append(f"| {name} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                     f"{r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | {r['gap_p99_ms']:.0f} / "
                     f"{r['gap_max_ms']:.0f} | {r['restores']} | "
                     f"{r['restore_stall_s']:.3f} | {', '.join(map(str, r['restore_s']))} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
