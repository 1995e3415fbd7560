"""The cost model's prediction error on the torch backend, raw against corrected, in the same runs
(issue 14 item 1: median error within 10% on this machine; round 11).

Each run serves BROS's `rtbe` workload at Table 2's lengths x 0.25 (bench/bros_compare.py's
torch setup: the shipped model, one torch thread, 96 blocks of 16) with the online correction on
(`EngineConfig.cost_correction`). The policy is told the corrected prediction; the log keeps the
base model's own (a profile from `shunter profile fit` with `--cost-profile`, else the model
the engine fits online), so both errors come from the same steps. `--busy-after S` starts a busy
loop (`python -c 'while 1: pass'`) S seconds into each run and kills it when the run ends: the
steps before and after it are reported apart, to show the host's load changing under the model.
`--replay` also reports, over the same logged steps, the error a correction of another window
would have had (replayed from the measured times: the steps, not the policy's choices, are the
same). Wall-clock numbers: the host's load average is printed beside each run.

    python bench/bros_cost.py --rates 1,3 --policies fcfs,bros --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig
from engine.cost_model_correction import DEFAULT_WINDOW, Correction
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.workloads import load_workload

WORKLOAD = "rtbe:rate={rate},duration=20,seed={seed},scale_lengths=0.25"
WINDOWS = (4, 8, 16, 32, 64)


def _median(errors: list[float]) -> float | None:
    return statistics.median(errors) if errors else None


Step = tuple[bool, float, float, float, float, int, int]
"""(prefill, engine time, predicted as told to the policy, raw prediction, measured, batch
sequences, batch tokens) of one logged iteration."""


def _errors(steps: list[Step]) -> dict[str, Any]:
    """Median error corrected / raw over `steps`."""
    return {"steps": len(steps),
            "median": _median([abs(t - m) / m for _, _, t, _, m, *_ in steps]),
            "raw_median": _median([abs(r - m) / m for _, _, _, r, m, *_ in steps])}


def _replay(steps: list[Step], window: int, block: int = 16) -> dict[str, float | None]:
    """Over the logged steps, what a correction of `window` (0: none) would have predicted:
    the median error per step, and the median error of the total time of each run of `block`
    consecutive steps, predicted with the factors known before the run's first step (what a
    deadline over the remaining iterations sums)."""
    corr, errors, totals = Correction(window) if window else None, [], []
    start: dict[bool, float] = {}
    told = meas = 0.0
    for n, (prefill, _, _, raw, measured, *_) in enumerate(steps):
        f = corr.factor(prefill=prefill) if corr else 1.0
        errors.append(abs(raw * f - measured) / measured)
        if n % block == 0:
            if meas:
                totals.append(abs(told - meas) / meas)
            told = meas = 0.0
            start = {p: corr.factor(prefill=p) if corr else 1.0 for p in (False, True)}
        told, meas = told + raw * start[prefill], meas + measured
        if corr:
            corr.observe(prefill=prefill, predicted_ms=raw, measured_ms=measured)
    return {"step": _median(errors), f"total_{block}": _median(totals)}


def one_run(policy: str, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(backend="torch", num_blocks=96, threads=1, max_num_seqs=64,
                          max_batched_tokens=256, max_queued_requests=100_000,
                          cost_profile=args.cost_profile, cost_correction=args.window)
    workload = load_workload(WORKLOAD.format(rate=rate, seed=args.seed))
    busy: dict[str, Any] = {}

    def start_busy() -> None:
        busy["t"] = time.monotonic()
        busy["proc"] = subprocess.Popen([sys.executable, "-c", "while 1: pass"])

    timer = threading.Timer(args.busy_after, start_busy) if args.busy_after else None
    load_before = os.getloadavg()[0]
    if timer:
        timer.start()
    try:
        run = run_one(parse_policy(policy), workload, config, progress=False)
    finally:
        if timer:
            timer.cancel()
            timer.join()  # (a loop it is starting now is in `busy` once this returns)
        if "proc" in busy:
            busy["proc"].kill()
            busy["proc"].wait()
    load_after = os.getloadavg()[0]
    if run.error or run.log is None:
        return {"policy": policy, "rate": rate, "error": run.error}
    log = run.log
    # every iteration with work is predicted, but for the first ones of an online fit
    busy_idx = [i for i, n in enumerate(log.batch_seqs) if n][-len(log.predictions):]
    steps = [(log.batch_tokens[i] > log.batch_seqs[i], log.time[i], told, raw, measured,
              log.batch_seqs[i], log.batch_tokens[i])
             for i, (told, measured), raw in zip(busy_idx, log.predictions, log.raw_predictions)
             if measured > 0]
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        (args.dump / f"{policy.replace('/', '_')}_{rate:g}.json").write_text(json.dumps(
            steps))
    out: dict[str, Any] = {
        "policy": policy, "rate": rate, "load_before": load_before, "load_after": load_after,
        "cost_model_error": run.metrics.cost_model_error, "all": _errors(steps),
        "decode": _errors([s for s in steps if not s[0]]),
        "prefill": _errors([s for s in steps if s[0]]),
        "be_requests_per_s": run.metrics.be_requests_per_s,
        "rt_ttft_attainment": (run.metrics.by_class.get("rt", {}).get("slo_attainment") or {}
                               ).get("ttft"),
    }
    if "t" in busy:
        out["before_busy"] = _errors([s for s in steps if s[1] < busy["t"]])
        out["with_busy"] = _errors([s for s in steps if s[1] >= busy["t"]])
    if args.replay:
        out["replay"] = {str(w): _replay(steps, w) for w in (0,) + WINDOWS}
    return out


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="1,3")
    p.add_argument("--policies", default="fcfs,bros")
    p.add_argument("--seed", type=int, default=9)
    p.add_argument("--cost-profile", default=None, help="a `shunter profile fit` JSON")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help="EngineConfig.cost_correction")
    p.add_argument("--busy-after", type=float, default=None, metavar="S")
    p.add_argument("--replay", action="store_true")
    p.add_argument("--dump", type=Path, default=None, help="a folder for each run's steps")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        for policy in args.policies.split(","):
            row = one_run(policy, rate, args)
            rows.append(row)
            a = row.get("all") or {}
            extra = ""
            if "with_busy" in row:
                extra = (f" | before busy loop {pct(row['before_busy']['median'])} / raw "
                         f"{pct(row['before_busy']['raw_median'])}, with it "
                         f"{pct(row['with_busy']['median'])} / raw "
                         f"{pct(row['with_busy']['raw_median'])}")
            print(f"rate {rate:g} {policy}: load {row.get('load_before', 0):.2f}->"
                  f"{row.get('load_after', 0):.2f}, {a.get('steps')} steps, median error "
                  f"corrected {pct(a.get('median'))} raw {pct(a.get('raw_median'))} (decode "
                  f"{pct((row.get('decode') or {}).get('median'))}/"
                  f"{pct((row.get('decode') or {}).get('raw_median'))}, prefill "
                  f"{pct((row.get('prefill') or {}).get('median'))}/"
                  f"{pct((row.get('prefill') or {}).get('raw_median'))}){extra}"
                  + (" | replay per step / 16-step total: " + ", ".join(
                      f"{w}: {pct(v['step'])}/{pct(v['total_16'])}"
                      for w, v in row["replay"].items()) if "replay" in row else ""),
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": rows},
                                   indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
