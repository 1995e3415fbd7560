"""Dispatch rules against each other on the same arrivals (simulator, virtual time): vLLM
data-parallel (vllm_dp) and KunServe, each with `dispatch least_load` (requests in flight, what
both ship with) and `dispatch freeness` (Llumnix's freeness: free KV after the queued requests'
over the batch; engine/cluster/dispatch.py), or any other rule named in --rules.

    python bench/kunserve_dispatch.py --trace azure-conv --start 1560 --duration 90 --rate 1x \
        --out bench/results/kunserve_dispatch_conv_1x

Writes P50/P99 TTFT, P50/P99 TPOT, drops/restores and how many requests each instance was sent
to <out>.json and a table to <out>.md.
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
    merge_report,
    policy_dir,
    run_row,
    sim_instance,
    trace_workload,
)
from engine.cluster.dispatch import DispatchTable
from policies import policy_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_args(ap)
    ap.add_argument("--policies", default="vllm_dp,kunserve",
                    help="vllm_dp (fcfs, recompute) or shipped KunServe policy names")
    ap.add_argument("--rules", default="least_load,freeness")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kunserve_dispatch"))
    ap.add_argument("--merge", action="store_true", help="re-run only --policies' rows into "
                    "--out's .json, keeping its other rows")
    args = ap.parse_args()
    spec, workload = trace_workload(args)
    base = sim_instance()
    out = Path(args.out)
    policies = policy_dir(out)
    sent: list[int] = []
    dispatched = DispatchTable.dispatched

    def counting(self, index, demand):  # how many requests each instance was sent
        sent[index] += 1
        return dispatched(self, index, demand)

    DispatchTable.dispatched = counting
    report = {"workload": spec, "runs": {}}
    for name in args.policies.split(","):
        parent = policy_path("fcfs" if name == "vllm_dp" else name)
        for rule in args.rules.split(","):
            path = policies / f"dispatch_{name}_{rule}.policy"
            path.write_text(f'policy {name}_{rule} extends "{parent}" {{\n  dispatch {rule}\n}}\n')
            sent[:] = [0] * 4
            label = "vllm_dp" if name == "vllm_dp" else "kunserve"
            key = f"{name} / {rule}"
            s = report["runs"][key] = run_row(label, path, workload, base) | {"sent": list(sent)}
            print(f"{key}: P99 TTFT {s['ttft_p99_s']:.3f} s, P50 TTFT {s['ttft_p50_s']:.3f} s, "
                  f"P50 TPOT {s['tpot_p50_ms']:.1f} ms, sent {sent}, events {s['events']}",
                  flush=True)
    DispatchTable.dispatched = dispatched
    if args.merge:
        report = merge_report(json.loads(out.with_suffix(".json").read_text()), report)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"# Dispatch rules: {spec}, 4 x llama3-8b-a10", "",
             ("| policy / dispatch | P50 TTFT s | P99 TTFT s | P50 TPOT ms | P99 TPOT ms | sent "
              "to 0/1/2/3 | groups (g) and restores (r), s |"), "|---|---|---|---|---|---|---|"]
    for key, r in report["runs"].items():
        ev = ", ".join(f"{t}{e[0]}" for t, e, _ in r["events"])
        lines.append(f"| {key} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                     f"{r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | "
                     f"{'/'.join(map(str, r['sent']))} | {ev} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
