"""Torch-vs-sim validation (issue 18): does the simulator's virtual clock agree with the real
engine's?

For each model (a tiny random Llama and a larger one), on this machine:

1. Record: serve every workload `--repeats` times on the torch backend (seed 0) and
   `--calibration-rounds` more times with other seeds (other arrivals and lengths: the
   calibration rounds, between the validation rounds), recording each step's batch shape and
   time on the device thread, the engine's own time between steps and every swap copy's
   start and end (`shunter/fidelity.py`).
2. Fit, on the calibration rounds only: the cost model on their steps
   (`sim.fit.fit_recorded_steps`), the engine's cost per iteration / sequence / sampled token
   on the gaps between back-to-back steps less the scheduler's planning
   (`shunter.fidelity.fit_engine_cost`), the copy link with torch copies, and what copies add
   to the steps and gaps they run beside (`shunter/contention.py`); a profile carrying all of
   them. The sim charges its own planning instead, times how much longer torch planned the
   first calibration round's workloads than the sim (`shunter.fidelity.planning_scale`).
3. Validate: run each workload on the sim with that profile; report each metric's sim error
   against the torch median beside
   the torch runs' own spread, and the fitted model's error on the validation runs' steps (held
   out: the fit never saw them). The method this replaces (a grid of shapes timed alone,
   calibrated in a running engine, no engine cost) is fitted and run beside it.

    python bench/sim_validation.py [--models tiny,larger] [--repeats 3] [--threads 1]
        [--calibration-rounds 2] [--save-runs FILE.pkl] [--no-grid]
        [--out bench/results/sim_validation.json]   # also writes the .md table beside it

Calibration rounds (seeds 1, 2, ...) alternate with the validation rounds (V C V C V), so that a
slow spell of this shared machine falls on fit and validation alike; the profile is fitted on
all of them, and beside it on the first alone (its held-out error and sim errors are reported
too). On this CPU backend the fit also measures what swap copies running beside the steps and
the engine's own work add to them (`shunter/contention.py`); the sim is run with and without
that charge.

The load average is recorded with every torch run: other processes on this machine move real
time by tens of percent (bench/results/NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attrs

from bench.sim_validation_md import markdown
from bench.sim_validation_parts import breakdown, planning_ratio, scaled_steps, without_hops
from engine.config import EngineConfig
from gpu.make_model import write_random_model
from gpu.profiler import measure, measure_copy
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.calibrate import calibrate_in_engine, calibrated, profile_for
from shunter.fidelity import (
    RecordedRun,
    fit_rows,
    planning_scale,
    profile_from_runs,
    recorded_run,
)
from shunter.workloads import load_workload
from sim.fit import fit_cost_model, fit_recorded_steps, relative_errors, total_ratio
from sim.profile import Profile, save_profile

BENCH = Path(__file__).resolve().parent
MODELS = {
    # name: (random Llama, factor on every workload's rate: its steps take 2.0-2.6x longer)
    "tiny": ({"arch": "llama", "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "vocab": 4096, "seed": 0}, 1.0),
    "larger": ({"arch": "llama", "layers": 6, "hidden": 384, "heads": 6, "kv_heads": 2, "vocab": 8192, "seed": 0}, 0.4),
}
CASES = (
    # label, workload ({N}: a rate, scaled per model), policy
    ("sharegpt 3/s", "sharegpt:requests=30,rate={3},scale_lengths=0.05", "fcfs"),
    ("sharegpt 12/s", "sharegpt:requests=80,rate={12},scale_lengths=0.05", "fcfs"),
    ("multiturn", "multiturn:conversations=10,rate={1},think=1,scale_lengths=0.05", "fcfs"),
    ("fastswitch, swaps", "sharegpt:requests=100,rate={25},scale_lengths=0.05,max_input=150",
     f"{BENCH / 'fastswitch_churn.policy'}@num_blocks=24,cpu_swap_blocks=1024"),
    ("rt/be", "rtbe:rate={3},duration=10,scale_lengths=0.1,batch_size=8", "bros"),
)
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "output_tokens_per_s")
TOLERANCE = 0.20
"""Issue 18: within 20% of the torch median, or within the torch runs' own spread if wider."""


def workload_spec(template: str, rate_scale: float) -> str:
    return re.sub(r"\{([0-9.]+)\}", lambda m: f"{float(m.group(1)) * rate_scale:g}", template)


def metrics_of(m: Any) -> dict[str, float]:
    return {"ttft_p50_ms": m.ttft_ms.p50, "ttft_p99_ms": m.ttft_ms.p99,
            "tpot_p50_ms": m.tpot_ms.p50, "output_tokens_per_s": m.output_tokens_per_s,
            "duration_s": m.duration_s, "iterations": m.iterations, "completed": m.completed,
            "failed": m.failed, "preemptions": m.preemptions, "swap_stall_s": m.swap.stall_s,
            "swap_blocks": m.swap.blocks_out + m.swap.blocks_in, "copy_ops": m.swap.copy_ops}


def torch_run(choice: Any, spec: str, cfg: EngineConfig, seed: int) -> tuple[RecordedRun, dict]:
    load_before = os.getloadavg()
    run = recorded_run(choice, load_workload(spec, seed=seed), cfg)
    steps = [s.compute_ms for s in run.steps]
    info = {**metrics_of(run.metrics), "wall_s": run.wall_s, "load_before": load_before,
            "load_after": os.getloadavg(), "steps": len(steps),
            "step_ms_mean": statistics.fmean(steps) if steps else 0.0,
            "swap_iteration_share": run.swap_iteration_share(),
            "swap_blocks_out": run.swap.get("blocks_out", 0),
            "swap_blocks_in": run.swap.get("blocks_in", 0), "copy_s": run.copy_s,
            "copy_calls": run.swap.get("copy_ops", 0),
            "copy_bytes": run.swap.get("bytes_in", 0) + run.swap.get("bytes_out", 0)}
    return run, info


def judge(torch_runs: list[dict], sim: dict) -> dict[str, Any]:
    out = {}
    for k in METRICS:
        vals = [r[k] for r in torch_runs]
        med = statistics.median(vals)
        spread = max(abs(v - med) for v in vals) / med
        err = (sim[k] - med) / med
        out[k] = {"torch_median": med, "torch_min": min(vals), "torch_max": max(vals),
                  "torch_spread": spread, "sim": sim[k], "error": err,
                  "within": abs(err) <= max(TOLERANCE, spread)}
    return out


def in_sample(choice: Any, spec: str, cfg: EngineConfig, run: RecordedRun, measured: dict,
              path: Path, gbps: float, dispatch: float, scale: float) -> dict[str, Any]:
    """The simulator's own structural error: a profile fitted on this very torch run (its steps
    and gaps), the same workload replayed on the sim, each metric against that run. What is
    left here is not the fit's generalization but what the sim does differently (queueing,
    admission, variance of real steps); with and without the engine's cost (and the copies'
    contention with it)."""
    profile, fit = profile_from_runs(cfg, [run], name="replay", kv_cache_mib=cfg.kv_cache_mib,
                                     gb_per_s=gbps, dispatch_us=dispatch, source="one run",
                                     net_of_scheduler=True)
    profile = attrs.evolve(profile, engine_cost=attrs.evolve(profile.engine_cost, planning_scale=scale))
    out: dict[str, Any] = {"fit_median_relative_error": fit.median_relative_error}
    uncharged = attrs.evolve(profile, engine_cost=None, copy_contention=None)
    for variant, p in (("charged", profile), ("uncharged", uncharged)):
        save_profile(p, path)
        o = run_one(choice, load_workload(spec, seed=0), EngineConfig(backend="sim", profile=str(path)),
                    progress=False)
        sim = metrics_of(o.metrics)
        out[variant] = {k: (sim[k] - measured[k]) / measured[k] for k in METRICS}
    return out


def record_rounds(name: str, args: argparse.Namespace, cases: list, torch_cfg: EngineConfig
                  ) -> tuple[dict[str, list[dict]], dict[str, list[RecordedRun]], list]:
    """Rounds over the workloads: `--repeats` validation rounds (seed 0) with the calibration
    rounds (seeds 1, 2, ...: other arrivals and lengths) between them (V C V C V), so that a
    slow spell of other work on this machine falls on the fit and the validation alike."""
    torch_runs: dict[str, list[dict]] = {label: [] for label, _, _ in cases}
    recorded: dict[str, list[RecordedRun]] = {label: [] for label, _, _ in cases}
    calib: list[tuple[RecordedRun, dict, int]] = []
    rounds: list[tuple[str, int]] = [("validate", 0)] * args.repeats
    for j in range(args.calibration_rounds):
        rounds.insert(min(1 + 2 * j, len(rounds)), ("calibrate", 1 + j))
    # warm-up (not recorded): the first run after a model is loaded pays its cold start
    recorded_run(cases[0][2], load_workload("sharegpt:requests=8,rate=8,scale_lengths=0.05",
                                            seed=9), torch_cfg)
    for i, (what, seed) in enumerate(rounds):
        for label, spec, choice in cases:
            run, info = torch_run(choice, spec, torch_cfg, seed=seed)
            if what == "calibrate":
                calib.append((run, {**info, "case": label}, seed))
            else:
                torch_runs[label].append(info)
                recorded[label].append(run)
            print(f"[{name}] round {i + 1}/{len(rounds)} ({what}, seed {seed}) {label}: "
                  + " ".join(f"{k}={info[k]:.2f}" for k in METRICS)
                  + f" load={info['load_after'][0]:.2f}", flush=True)
    return torch_runs, recorded, calib


def sim_errors(choice: Any, spec: str, cfg: EngineConfig, verdict: dict) -> dict | str:
    """One sim run's four errors against the torch medians of `verdict`."""
    o = run_one(choice, load_workload(spec, seed=0), cfg, progress=False)
    if o.error:
        return o.error
    m = metrics_of(o.metrics)
    return {k: (m[k] - v["torch_median"]) / v["torch_median"] for k, v in verdict.items()}


def with_planning_scale(profile: Profile, calib: list, cases: list, path: Path
                        ) -> tuple[Profile, dict[str, float]]:
    """The profile (fitted net of torch's planning) with `planning_scale`: torch's planning of
    the first calibration round's workloads over the sim's own planning of the same; and that
    ratio per workload (`planning_ratio`)."""
    save_profile(profile, path)
    cfg = EngineConfig(backend="sim", profile=str(path))
    runs, sim_s, ratios = [], 0.0, {}
    for run, info, seed in calib:
        if seed == 1:
            _, spec, choice = next(c for c in cases if c[0] == info["case"])
            p = run_one(choice, load_workload(spec, seed=seed), cfg, progress=False).metrics
            sim_s += p.scheduler_ms_per_iteration.mean * p.scheduler_ms_per_iteration.count / 1e3
            ratios[info["case"]] = planning_ratio(run, p.scheduler_ms_per_iteration.mean)
            runs.append(run)
    scale = planning_scale(runs, sim_s)
    return attrs.evolve(profile, engine_cost=attrs.evolve(profile.engine_cost, planning_scale=scale)), ratios


def held_out(cost: Any, rows: list) -> dict[str, float]:
    return {"held_out_median_relative_error": float(statistics.median(relative_errors(cost, rows))),
            "held_out_predicted_over_measured_total": total_ratio(cost, rows)}


def validate_model(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    arch, rate_scale = MODELS[name]
    model = write_random_model(tmp / name, **arch)
    torch_cfg = EngineConfig(model=model, device="cpu", threads=args.threads)
    cases = [(label, workload_spec(t, rate_scale), parse_policy(p))
             for i, (label, t, p) in enumerate(CASES) if args.cases is None or i in args.cases]
    torch_runs, recorded, calib = record_rounds(name, args, cases, torch_cfg)
    if args.save_runs is not None:
        saved = pickle.loads(args.save_runs.read_bytes()) if args.save_runs.exists() else {}
        saved[name] = {"calibration": calib, "validation": recorded, "torch": torch_runs}
        args.save_runs.write_bytes(pickle.dumps(saved))
    began = time.perf_counter()
    gbps, dispatch = measure_copy("cpu")
    profiles = {}
    for variant, runs, net in (("all", [r for r, _, _ in calib], True),
                               ("one_round", [r for r, _, seed in calib if seed == 1], True),
                               ("gross", [r for r, _, _ in calib], False)):
        profiles[variant] = profile_from_runs(
            torch_cfg, runs, name=f"{name}-cpu", kv_cache_mib=torch_cfg.kv_cache_mib, gb_per_s=gbps,
            dispatch_us=dispatch, source=f"{len(runs)} runs of {len(cases)} workloads",
            net_of_scheduler=net)
    profile, ratios = with_planning_scale(profiles["all"][0], calib, cases, tmp / f"{name}-scale.json")
    fit = profiles["all"][1]
    scale = profile.engine_cost.planning_scale
    one = profiles["one_round"][0]
    cfgs = {}
    for variant, p in (("main", profile), ("no_contention", attrs.evolve(profile, copy_contention=None)),
                       ("one_round", attrs.evolve(one, engine_cost=attrs.evolve(
                           one.engine_cost, planning_scale=scale))),
                       ("gross_planning", profiles["gross"][0]), ("round3", without_hops(profile)),
                       ("steps_x1.05", scaled_steps(profile, 1.05))):
        save_profile(p, tmp / f"{name}-cpu-{variant}.json")
        cfgs[variant] = EngineConfig(backend="sim", profile=str(tmp / f"{name}-cpu-{variant}.json"))
    fit_s = time.perf_counter() - began
    grid = old = old_cfg = None
    if args.grid:  # the method round 1 replaced: a grid of shapes timed alone, calibrated by
        # a few closed-loop batches in a running engine, no engine cost; in the same window
        grid = fit_cost_model(measure(torch_cfg, repeats=3), source="grid")
        grid = calibrated(grid, *calibrate_in_engine(torch_cfg, grid.cost))
        old = profile_for(torch_cfg, name=f"{name}-cpu-grid", fit=grid, gb_per_s=gbps,
                          kv_cache_mib=torch_cfg.kv_cache_mib, dispatch_us=dispatch)
        save_profile(old, tmp / f"{name}-cpu-grid.json")
        old_cfg = EngineConfig(backend="sim", profile=str(tmp / f"{name}-cpu-grid.json"))
    results = []
    for label, spec, choice in cases:
        sims = []
        for _ in range(args.repeats):
            o = run_one(choice, load_workload(spec, seed=0), cfgs["main"], progress=False)
            if o.error:
                sys.exit(f"{label} on sim: {o.error}")
            sims.append(metrics_of(o.metrics))
        sim = {k: statistics.median(s[k] for s in sims) for k in sims[0]}
        verdict = judge(torch_runs[label], sim)
        variants = {}
        variants["gross_planning_error"] = sim_errors(choice, spec, cfgs["gross_planning"], verdict)
        if args.calibration_rounds > 1:
            variants["one_round_error"] = sim_errors(choice, spec, cfgs["one_round"], verdict)
        if profile.copy_contention is not None and any(t["copy_calls"] for t in torch_runs[label]):
            variants["no_contention_error"] = sim_errors(choice, spec, cfgs["no_contention"], verdict)
            variants["round3_mechanics_error"] = sim_errors(choice, spec, cfgs["round3"], verdict)
        variants["steps_x1.05_error"] = sim_errors(choice, spec, cfgs["steps_x1.05"], verdict)
        replay = in_sample(choice, spec, torch_cfg, recorded[label][0], torch_runs[label][0],
                           tmp / f"{name}-{len(results)}-replay.json", gbps, dispatch, scale)
        rows_out = fit_rows(recorded[label])
        err = relative_errors(profile.cost, rows_out)
        results.append({"case": label, "workload": spec, "policy": choice.label,
                        "torch": torch_runs[label], "sim": sims, "judged": verdict, **variants,
                        **({"grid_profile": {"error": sim_errors(choice, spec, old_cfg, verdict)}}
                           if old_cfg else {}),
                        "breakdown": breakdown(recorded[label], {"recorded": profile,
                                                                 **({"grid": old} if old else {})}),
                        "in_sample_replay": replay,
                        "copies": {"torch_s": [t["copy_s"] for t in torch_runs[label]],
                                   "model_s": [profile.link.copy_s(t["copy_calls"], t["copy_bytes"])
                                               for t in torch_runs[label]]},
                        "predicted_over_measured_by_run": [total_ratio(profile.cost, fit_rows([r]))
                                                           for r in recorded[label]],
                        "held_out_steps": {"rows": len(rows_out),
                                           "median_relative_error": float(statistics.median(err)),
                                           "predicted_over_measured_total": total_ratio(profile.cost, rows_out)}})
        print(f"[{name}] {label}: " + " ".join(
            f"{k} {v['error']:+.1%} (torch spread {v['torch_spread']:.1%})" for k, v in verdict.items()),
            flush=True)
    all_out = fit_rows([r for rs in recorded.values() for r in rs])
    one_cost = profiles["one_round"][0].cost
    return {"model": arch, "rate_scale": rate_scale, "profile": profile.to_json(),
            "planning_ratio_by_case": ratios,
            "fit": {"rows": fit.rows, "train_median_relative_error": fit.median_relative_error,
                    "calibration_runs": len(calib), "held_out_rows": len(all_out),
                    **held_out(profile.cost, all_out), "seconds": fit_s,
                    **({"one_round": {"rows": profiles["one_round"][1].rows,
                                      **held_out(one_cost, all_out)}}
                       if args.calibration_rounds > 1 else {}),
                    "no_multi_row": held_out(fit_recorded_steps(
                        fit_rows([r for r, _, _ in calib], skip_copying=True), source="",
                        multi_row=False).cost, all_out),
                    **({"grid_fit": {"rows": grid.rows, "median_relative_error": grid.median_relative_error,
                                     "calibration": grid.calibration, **held_out(old.cost, all_out)}}
                       if grid else {})},
            "calibration_runs": [{**info, "seed": seed} for _, info, seed in calib],
            "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "sim_validation.json")
    ap.add_argument("--models", default="tiny,larger")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="runs per side and workload")
    ap.add_argument("--calibration-rounds", type=int, default=2,
                    help="rounds (seeds 1, 2, ...) the profile is fitted on")
    ap.add_argument("--save-runs", type=Path, default=None, metavar="PKL",
                    help="also pickle every recorded torch run here (for later analysis)")
    ap.add_argument("--cases", type=lambda v: {int(i) for i in v.split(",")}, default=None,
                    help="only these workloads, by index into CASES (0-based, comma-separated)")
    ap.add_argument("--no-grid", dest="grid", action="store_false",
                    help="leave out the grid profile (the method round 1 replaced; saves time)")
    ap.add_argument("--render", type=Path, default=None, metavar="JSON",
                    help="only write the .md table of an earlier run's JSON")
    args = ap.parse_args()
    if args.render is not None:
        args.render.with_suffix(".md").write_text(markdown(json.loads(args.render.read_text())))
        return
    tmp = Path(tempfile.mkdtemp(prefix="shunter-validation-"))
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    report: dict[str, Any] = {"started": started, "threads": args.threads,
                              "repeats": args.repeats, "calibration_rounds": args.calibration_rounds,
                              "tolerance": TOLERANCE, "grid": args.grid, "models": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        report["models"][name] = validate_model(name, args, tmp)
        report["ended"] = time.strftime("%H:%M:%S", time.gmtime())
        args.out.write_text(json.dumps(report, indent=1) + "\n")  # each model as it is done
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
