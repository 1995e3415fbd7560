"""Where the static 2-stage pipeline's P99 TTFT lead over KunServe comes from, request by
request (simulator, virtual time): `pipeline2` (bench/kunserve.py's static pipeline) and a
KunServe policy on the same arrivals. For each request: TTFT split into queueing (arrival to its
first scheduled step) and prefill (first scheduled step to first token), the instance it was
sent to, and under KunServe whether that instance was alone or in a group when the request was
first scheduled. Prints both runs' tails side by side and the split by KunServe's state.

    python bench/kunserve_pipeline_gap.py --trace azure-conv --start 1560 --duration 90 \
        --rate 0.95x [--policy kunserve] [--chain] [--out bench/results/kunserve_gap_conv_095x]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench.kunserve as bench
from bench.kunserve import pct
from bench.kunserve_trace import add_trace_args, policy_dir, sim_instance, trace_workload
from engine.cluster.dispatch import DispatchTable
from policies import policy_path


def run_logged(label: str, policy_file: Path, workload, base) -> tuple[list[dict], list]:
    """One run: a row per request in arrival order, and the groups' events as (seconds from
    the start, event, members)."""
    sent: list[tuple[float, int]] = []
    dispatched = DispatchTable.dispatched

    def counting(self, index, demand):
        import anyio
        sent.append((anyio.current_time(), index))
        return dispatched(self, index, demand)

    DispatchTable.dispatched = counting
    try:
        result, cluster, _, _ = bench.run(label, policy_file, workload, base, 4)
    finally:
        DispatchTable.dispatched = dispatched
    t0 = result.started
    events = [(round(e["t"] - t0, 2), e["event"], tuple(e["members"]))
              for e in (cluster or {}).get("events", [])]
    tls = sorted(result.timelines, key=lambda t: (t.arrival, t.prompt_tokens))
    rows = []
    for (_, where), t in zip(sorted(sent), tls):
        start = (t.first_scheduled or t.arrival) - t0
        rows.append({"arrival": round(t.arrival - t0, 3), "prompt": t.prompt_tokens,
                     "ttft": t.ttft_s, "queue": start - (t.arrival - t0),
                     "prefill": t.ttft_s - (start - (t.arrival - t0)), "sent": where,
                     "grouped": grouped(events, where, start) if events else None,
                     "preemptions": t.preemptions})
    return rows, events


def grouped(events: list, instance: int, at: float) -> bool:
    """Whether `instance` was in a group at `at` (seconds from the start)."""
    state = False
    for t, event, members in events:
        if t > at:
            break
        if instance in members:
            state = event == "group"
    return state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_args(ap, rate="0.95x")
    ap.add_argument("--policy", default="kunserve")
    ap.add_argument("--chain", action="store_true", help="as bench/kunserve.py --chain")
    ap.add_argument("--out", default="", help="write both runs' rows to <out>.json")
    args = ap.parse_args()
    spec, workload = trace_workload(args)
    base = sim_instance()
    bench.CHAIN = args.chain
    pdir = policy_dir(Path(args.out or ROOT / "bench" / "results" / "x"))
    pipe = pdir / "pipeline2.policy"
    pipe.write_text(bench.BASELINE_POLICIES["pipeline2"].replace(
        '"fcfs.policy"', f'"{policy_path("fcfs")}"'))
    pp, _ = run_logged("pipeline2", pipe, workload, base)
    ks, events = run_logged("kunserve", Path(policy_path(args.policy)), workload, base)
    assert [r["arrival"] for r in pp] == [r["arrival"] for r in ks]
    print(f"# {spec}: pipeline2 against {args.policy}" + (" (--chain)" if args.chain else ""))
    for name, rows in (("pipeline2", pp), (args.policy, ks)):
        print(f"{name}: P99 TTFT {pct([r['ttft'] for r in rows], 99):.3f} s, P50 "
              f"{pct([r['ttft'] for r in rows], 50):.3f} s; queue P50/P99 "
              f"{pct([r['queue'] for r in rows], 50):.3f}/{pct([r['queue'] for r in rows], 99):.3f}"
              f" s; prefill P50/P99 {pct([r['prefill'] for r in rows], 50):.3f}/"
              f"{pct([r['prefill'] for r in rows], 99):.3f} s")
    print("groups (g) and restores (r):", ", ".join(f"{t}{e[0]}{list(m)}" for t, e, m in events))
    n = len(ks) // 100 + 3
    for name, mine, other in (((args.policy), ks, pp), ("pipeline2", pp, ks)):
        print(f"\n{name}'s {n} worst TTFTs (arrival s, prompt; {args.policy}: TTFT, queue, "
              f"prefill, sent, grouped | pipeline2: TTFT, queue, prefill):")
        for k in sorted(range(len(mine)), key=lambda k: -mine[k]["ttft"])[:n]:
            a, b = ks[k], pp[k]
            print(f"  {a['arrival']:7.2f} {a['prompt']:6d} | {a['ttft']:5.2f} {a['queue']:5.2f} "
                  f"{a['prefill']:5.2f} {a['sent']} {'G' if a['grouped'] else '-'} | "
                  f"{b['ttft']:5.2f} {b['queue']:5.2f} {b['prefill']:5.2f}")
    print(f"\nby {args.policy}'s state when first scheduled (requests; mean TTFT "
          f"{args.policy} / pipeline2; mean queue; mean prefill):")
    for state in (False, True):
        ids = [k for k, r in enumerate(ks) if r["grouped"] is state]
        if not ids:
            continue

        def mean(rows, key, ids=ids):
            return sum(rows[k][key] for k in ids) / len(ids)
        print(f"  {'grouped' if state else 'alone'}: {len(ids)}; TTFT {mean(ks, 'ttft'):.3f} / "
              f"{mean(pp, 'ttft'):.3f} s; queue {mean(ks, 'queue'):.3f} / {mean(pp, 'queue'):.3f}"
              f" s; prefill {mean(ks, 'prefill'):.3f} / {mean(pp, 'prefill'):.3f} s")
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"workload": spec, "policy": args.policy, "chain": args.chain, "pipeline2": pp,
             args.policy: ks, "events": events}, indent=0))


if __name__ == "__main__":
    main()
