"""Event timelines of KunServe runs on the same arrivals (simulator, virtual time): what the
coordinator's monitor saw and decided, when groups formed, how long each KV exchange held its
link and stalled activations, which queued requests moved to a head, how long the monitor's
rounds were held up, and which requests make the P99 TTFT (where they were sent and how long
they queued). Diagnoses why two runs of the ladder differ (issue 16, round 4).

    python bench/kunserve_timeline.py --trace azure-conv --start 1560 --duration 90 --rate 1x \
        --runs kunserve_drop,kunserve_exchange --window 28,50

Instruments the classes it reads by wrapping their methods for the length of one run (the
simulator is deterministic: the wrapped runs are the runs bench/kunserve.py makes).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from contextlib import contextmanager
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench.kunserve as bench
from bench.kunserve_trace import add_trace_args, sim_instance, trace_workload
from engine.cluster.dispatch import DispatchTable
from engine.cluster.overload import OverloadMonitor
from policies import policy_path
from shunter.cluster.groups import SimGroups
from sim.exchange import SimExchange


@contextmanager
def recording(log: dict):
    """Wraps the monitor's decision, the exchanges, dispatch and the group manager's moves."""
    decide, run, dispatched = OverloadMonitor.decide, SimExchange.run, DispatchTable.dispatched
    form, move = SimGroups._form, SimGroups._move

    def w_decide(self, stats, alive, **kw):
        units = {i: (st.free_blocks, st.head_tokens, st.queued_tokens, st.waiting, st.running,
                     self.member_of(i) is not None) for i, st in enumerate(stats) if st}
        action = decide(self, stats, alive, **kw)
        log["rounds"].append((anyio.current_time(), units, list(self.fired),
                              type(action).__name__ if action else None))
        return action

    async def w_run(self, queue, arrived):
        rec = {"start": anyio.current_time(), "bytes": sum(b for _, b in queue), "n": len(queue)}
        log["exchanges"].append(rec)
        await run(self, queue, arrived)
        rec.update(end=anyio.current_time(), stalled=self.stalled_s)

    def w_dispatched(self, index, demand):
        log["dispatch"].append((anyio.current_time(), index))
        return dispatched(self, index, demand)

    async def w_form(self, g):
        t0 = anyio.current_time()
        await form(self, g)
        log["forms"].append((t0, anyio.current_time(), g.members))

    async def w_move(self, src, head, *, queued_only):
        t0 = anyio.current_time()
        moved = await move(self, src, head, queued_only=queued_only)
        log["moves"].append((t0, anyio.current_time(), src, head, len(moved)))
        return moved

    OverloadMonitor.decide, SimExchange.run, DispatchTable.dispatched = w_decide, w_run, w_dispatched
    SimGroups._form, SimGroups._move = w_form, w_move
    try:
        yield
    finally:
        OverloadMonitor.decide, SimExchange.run, DispatchTable.dispatched = decide, run, dispatched
        SimGroups._form, SimGroups._move = form, move


def show(label: str, log: dict, result, lo: float, hi: float) -> None:
    t0 = result.started
    s = bench.summarize(result, None)
    print(f"\n=== {label}: P99 TTFT {s['ttft_p99_s']:.3f} s, P50 {s['ttft_p50_s']:.3f} s, "
          f"P50 TPOT {s['tpot_p50_ms']:.1f} ms")
    for a, b, members in log["forms"]:
        print(f"  group {members}: asked {a - t0:.2f} s, formed {b - t0:.2f} s")
    for x in log["exchanges"]:
        print(f"  exchange {x['start'] - t0:.2f} -> {x.get('end', x['start']) - t0:.2f} s, "
              f"{x['bytes'] / 1e9:.2f} GB, {x['n']} requests, activations stalled "
              f"{x.get('stalled', 0.0):.3f} s")
    for a, b, src, head, n in log["moves"]:
        print(f"  moved {n} queued from {src} to head {head}: {a - t0:.2f} -> {b - t0:.2f} s")
    times = [r[0] - t0 for r in log["rounds"]]
    gaps = [(a, b - a) for a, b in itertools.pairwise(times) if b - a > 0.3]
    print(f"  monitor rounds {len(times)}; held up over 0.3 s {len(gaps)} times, "
          f"{sum(g for _, g in gaps):.1f} s in all: "
          + ", ".join(f"{a:.2f} (+{g:.2f})" for a, g in gaps))
    print("  rounds in the window (unit: free blocks / head-of-line blocks / queued blocks / "
          "waiting-running; m = a member):")
    bs = 16
    for t, units, fired, action in log["rounds"]:
        t -= t0
        if lo <= t <= hi and (fired or action or (t % 1.0) < 0.05):
            cells = " ".join(f"{i}:{'m' if m else ''}{f}/{h // bs}/{q // bs}/{w}-{r}"
                             for i, (f, h, q, w, r, m) in units.items())
            print(f"  {t:7.2f} fired {fired} {action or ''} | {cells}")
    sent = sorted(log["dispatch"])
    tls = sorted(result.timelines, key=lambda t: t.arrival)
    where = {id(t): i for (_, i), t in zip(sent, tls)}
    top = sorted(tls, key=lambda t: -(t.ttft_s or 0))[:len(tls) // 100 + 3]
    print("  the tail (arrival s, TTFT s, sent to, prompt tokens, queued s):")
    for t in top:
        queued = (t.first_scheduled or t.arrival) - t.arrival
        print(f"    {t.arrival - t0:7.2f} {t.ttft_s:6.2f} {where.get(id(t))} "
              f"{t.prompt_tokens:6d} {queued:5.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_args(ap)
    ap.add_argument("--profile", default="llama3-8b-a10")
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--runs", default="kunserve_drop,kunserve_exchange")
    ap.add_argument("--window", default="0,1e9", help="seconds: rounds printed in this window")
    args = ap.parse_args()
    _, workload = trace_workload(args)
    base = sim_instance(args.profile, args.num_blocks)
    lo, hi = (float(x) for x in args.window.split(","))
    for label in args.runs.split(","):
        log = {"rounds": [], "exchanges": [], "dispatch": [], "forms": [], "moves": []}
        with recording(log):
            result, _, _, _ = bench.run(label, policy_path(label), workload, base, 4)
        show(label, log, result, lo, hi)


if __name__ == "__main__":
    main()
