"""Torch-vs-sim validation (issue 18): does the simulator's virtual clock agree with the real
engine's?

For each model (a tiny random Llama and a larger one), on this machine:

1. Record: serve every workload `--repeats` times on the torch backend (seed 0) and once more
   with another seed (other arrivals and lengths: the calibration round, second of the rounds,
   so that load from other processes falls on fit and validation alike), recording each step's
   batch shape and time on the device thread and the engine's own time between steps
   (`shunter/fidelity.py`).
2. Fit, on the calibration round only: the cost model on its steps (`sim.fit.fit_recorded_steps`), the engine's cost per
   iteration / sequence / sampled token on the gaps between back-to-back steps
   (`shunter.fidelity.fit_engine_cost`), the copy link with torch copies; a profile carrying
   all three (`engine_cost`).
3. Validate: run each workload on the sim with that profile; report each metric's sim error against the torch median beside
   the torch runs' own spread, and the fitted model's error on the validation runs' steps (held
   out: the fit never saw them). The method this replaces (a grid of shapes timed alone,
   calibrated in a running engine, no engine cost) is fitted and run beside it.

    python bench/sim_validation.py [--models tiny,larger] [--repeats 3] [--threads 1]
        [--out bench/results/sim_validation.json]   # also writes the .md table beside it

The load average is recorded with every torch run: other processes on this machine move real
time by tens of percent (bench/results/NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attrs

from engine.config import EngineConfig
from gpu.make_model import write_random_model
from gpu.profiler import measure, measure_copy
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.calibrate import calibrate_in_engine, calibrated, profile_for
from shunter.fidelity import RecordedRun, engine_gaps, fit_rows, profile_from_runs, recorded_run
from shunter.workloads import load_workload
from sim.fit import fit_cost_model, relative_errors, total_ratio
from sim.profile import save_profile

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


def kind(shape: Any) -> str:
    if shape.prefill_tokens and shape.decode_seqs:
        return "mixed"
    return "prefill" if shape.prefill_tokens else "decode"


def breakdown(runs: list[RecordedRun], profiles: dict[str, Any]) -> dict[str, Any]:
    """Where the clocks part on the validation runs' steps: per step kind, its share of the
    measured step time and each profile's predicted/measured total; the engine's own time
    between back-to-back steps against the step time."""
    rows = fit_rows(runs)
    out: dict[str, Any] = {}
    for k in ("prefill", "mixed", "decode"):
        part = [(s, ms) for s, ms in rows if kind(s) == k]
        if part:
            out[k] = {"steps": len(part), "share_of_step_time": sum(ms for _, ms in part)
                      / sum(ms for _, ms in rows),
                      **{f"{name}_predicted_over_measured": total_ratio(p.cost, part)
                         for name, p in profiles.items()}}
    gaps = [(s, g) for r in runs for s, g, _ in engine_gaps(r)]
    out["engine_gap_ms_median"] = statistics.median(g for _, g in gaps) if gaps else 0.0
    out["engine_gap_over_step_time"] = (sum(g for _, g in gaps) / sum(s.compute_ms for s, _ in gaps)
                                        if gaps else 0.0)
    return out


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
              path: Path, gbps: float, dispatch: float) -> dict[str, Any]:
    """The simulator's own structural error: a profile fitted on this very torch run (its steps
    and gaps), the same workload replayed on the sim, each metric against that run. What is
    left here is not the fit's generalization but what the sim does differently (queueing,
    admission, variance of real steps); with and without the engine's cost."""
    profile, fit = profile_from_runs(cfg, [run], name="replay", kv_cache_mib=cfg.kv_cache_mib,
                                     gb_per_s=gbps, dispatch_us=dispatch, source="one run")
    out: dict[str, Any] = {"fit_median_relative_error": fit.median_relative_error}
    for variant, p in (("charged", profile), ("uncharged", attrs.evolve(profile, engine_cost=None))):
        save_profile(p, path)
        o = run_one(choice, load_workload(spec, seed=0), EngineConfig(backend="sim", profile=str(path)),
                    progress=False)
        sim = metrics_of(o.metrics)
        out[variant] = {k: (sim[k] - measured[k]) / measured[k] for k in METRICS}
    return out


def validate_model(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    arch, rate_scale = MODELS[name]
    model = write_random_model(tmp / name, **arch)
    torch_cfg = EngineConfig(model=model, device="cpu", threads=args.threads)
    cases = [(label, workload_spec(t, rate_scale), parse_policy(p))
             for i, (label, t, p) in enumerate(CASES) if args.cases is None or i in args.cases]
    torch_runs: dict[str, list[dict]] = {label: [] for label, _, _ in cases}
    recorded: dict[str, list[RecordedRun]] = {label: [] for label, _, _ in cases}
    calib: list[tuple[RecordedRun, dict]] = []
    # rounds over the workloads, the calibration round (seed 1: other arrivals and lengths)
    # second, so a burst of other work on this machine hits the fit and the validation alike
    rounds = ["validate"] * args.repeats
    rounds.insert(min(1, len(rounds)), "calibrate")
    for i, what in enumerate(rounds):
        for label, spec, choice in cases:
            run, info = torch_run(choice, spec, torch_cfg, seed=1 if what == "calibrate" else 0)
            if what == "calibrate":
                calib.append((run, info))
            else:
                torch_runs[label].append(info)
                recorded[label].append(run)
            print(f"[{name}] round {i + 1}/{len(rounds)} ({what}) {label}: "
                  + " ".join(f"{k}={info[k]:.2f}" for k in METRICS)
                  + f" load={info['load_after'][0]:.2f}", flush=True)
    began = time.perf_counter()
    gbps, dispatch = measure_copy("cpu")
    profile, fit = profile_from_runs(torch_cfg, [r for r, _ in calib], name=f"{name}-cpu",
                                     kv_cache_mib=torch_cfg.kv_cache_mib, gb_per_s=gbps,
                                     dispatch_us=dispatch, source=f"{len(cases)} workloads")
    path = tmp / f"{name}-cpu.json"
    save_profile(profile, path)
    sim_cfg = EngineConfig(backend="sim", profile=str(path))
    fit_s = time.perf_counter() - began
    # the method this replaces, in the same window: a grid of shapes timed alone, calibrated
    # by a few closed-loop batches in a running engine, no engine cost
    grid = fit_cost_model(measure(torch_cfg, repeats=3), source="grid")
    grid = calibrated(grid, *calibrate_in_engine(torch_cfg, grid.cost))
    old = profile_for(torch_cfg, name=f"{name}-cpu-grid", fit=grid, kv_cache_mib=torch_cfg.kv_cache_mib,
                      gb_per_s=gbps, dispatch_us=dispatch)
    save_profile(old, tmp / f"{name}-cpu-grid.json")
    old_cfg = EngineConfig(backend="sim", profile=str(tmp / f"{name}-cpu-grid.json"))
    results = []
    for label, spec, choice in cases:
        sims = []
        for _ in range(args.repeats):
            o = run_one(choice, load_workload(spec, seed=0), sim_cfg, progress=False)
            if o.error:
                sys.exit(f"{label} on sim: {o.error}")
            sims.append(metrics_of(o.metrics))
        sim = {k: statistics.median(s[k] for s in sims) for k in sims[0]}
        o = run_one(choice, load_workload(spec, seed=0), old_cfg, progress=False)
        old_sim = metrics_of(o.metrics) if not o.error else None
        replay = in_sample(choice, spec, torch_cfg, recorded[label][0], torch_runs[label][0],
                           tmp / f"{name}-{len(results)}-replay.json", gbps, dispatch)
        rows_out = fit_rows(recorded[label])
        err = relative_errors(profile.cost, rows_out)
        verdict = judge(torch_runs[label], sim)
        results.append({"case": label, "workload": spec, "policy": choice.label,
                        "torch": torch_runs[label], "sim": sims, "judged": verdict,
                        "grid_profile": {"sim": old_sim, "error": {
                            k: (old_sim[k] - v["torch_median"]) / v["torch_median"]
                            for k, v in verdict.items()} if old_sim else o.error},
                        "breakdown": breakdown(recorded[label], {"recorded": profile, "grid": old}),
                        "in_sample_replay": replay,
                        "copies": {"torch_s": [t["copy_s"] for t in torch_runs[label]],
                                   "model_s": [profile.link.copy_s(t["copy_calls"], t["copy_bytes"])
                                               for t in torch_runs[label]]},
                        "held_out_steps": {"rows": len(rows_out),
                                           "median_relative_error": float(statistics.median(err)),
                                           "predicted_over_measured_total": total_ratio(profile.cost, rows_out)}})
        print(f"[{name}] {label}: " + " ".join(
            f"{k} {v['error']:+.1%} (torch spread {v['torch_spread']:.1%})" for k, v in verdict.items()),
            flush=True)
    all_out = fit_rows([r for rs in recorded.values() for r in rs])
    return {"model": arch, "rate_scale": rate_scale, "profile": profile.to_json(),
            "fit": {"rows": fit.rows, "train_median_relative_error": fit.median_relative_error,
                    "held_out_rows": len(all_out),
                    "held_out_median_relative_error": float(statistics.median(
                        relative_errors(profile.cost, all_out))),
                    "held_out_predicted_over_measured_total": total_ratio(profile.cost, all_out),
                    "seconds": fit_s, "grid_fit": {
                        "rows": grid.rows, "median_relative_error": grid.median_relative_error,
                        "calibration": grid.calibration,
                        "held_out_median_relative_error": float(statistics.median(
                            relative_errors(old.cost, all_out))),
                        "held_out_predicted_over_measured_total": total_ratio(old.cost, all_out)}},
            "calibration_runs": [info for _, info in calib], "results": results}


def markdown(report: dict[str, Any]) -> str:
    lines = ["# Simulator vs torch backend (issue 18)", "",
             (f"`python bench/sim_validation.py --threads {report['threads']} --repeats "
             f"{report['repeats']}`, {report['started']} - {report['ended']} UTC. Each cell: the sim's "
             f"error against the median of {report['repeats']} torch runs [the torch runs' own "
             f"spread: their largest distance from that median]; **bold** where it lies outside "
             f"both 20% and that spread. `grid profile`: the same four errors for the method this "
             f"replaces (a grid of shapes timed alone, in-engine calibrated, no engine cost), "
             f"fitted in the same window. `in-sample replay`: the four errors of a sim whose "
             f"profile was fitted on the first torch run itself, against that run, with and "
             f"without the engine's cost: the simulator's own error, apart from the fit's."), ""]
    for name, m in report["models"].items():
        f, g = m["fit"], m["fit"]["grid_fit"]
        lines += [(f"## {name}: {m['model']['layers']} layers, hidden {m['model']['hidden']} "
                  f"(rates x{m['rate_scale']})"), "",
                  (f"Cost model fitted on {f['rows']} recorded steps (seed-1 runs): median error "
                  f"{f['train_median_relative_error']:.1%}; on the {f['held_out_rows']} steps of the "
                  f"validation runs (held out): median {f['held_out_median_relative_error']:.1%}, "
                  f"total time predicted/measured {f['held_out_predicted_over_measured_total']:.3f} "
                  f"(grid profile: {g['held_out_median_relative_error']:.1%}, "
                  f"{g['held_out_predicted_over_measured_total']:.3f}). Engine cost charged: "
                  f"{m['profile']['engine_cost']['per_iteration_ms']:.3f} ms per iteration + "
                  f"{m['profile']['engine_cost']['per_seq_ms']:.4f} per sequence + "
                  f"{m['profile']['engine_cost']['per_sampled_ms']:.4f} per sampled token, "
                  f"{m['profile']['engine_cost']['before_share']:.0%} of it before the step."), "",
                  ("| workload | TTFT p50 | TTFT p99 | TPOT p50 | output tok/s | grid profile | "
                   "in-sample replay, charged; uncharged | torch load avg | swap iterations, "
                   "stall s torch / sim, copy s torch / model |"),
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in m["results"]:
            cells = []
            for k in METRICS:
                v = r["judged"][k]
                cell = f"{v['error']:+.1%} [{v['torch_spread']:.1%}]"
                cells.append(cell if v["within"] else f"**{cell}**")
            old = r["grid_profile"]["error"]
            old_cell = (" / ".join(f"{old[k]:+.0%}" for k in METRICS) if isinstance(old, dict)
                        else str(old))
            loads = [t["load_after"][0] for t in r["torch"]]
            swaps = statistics.median(t["swap_iteration_share"] for t in r["torch"])
            stall_t = statistics.median(t["swap_stall_s"] for t in r["torch"])
            stall_s = statistics.median(t["swap_stall_s"] for t in r["sim"])
            rep = r["in_sample_replay"]
            rep_cell = "; ".join(" / ".join(f"{rep[v][k]:+.0%}" for k in METRICS)
                                 for v in ("charged", "uncharged"))
            lines.append(f"| {r['case']} | " + " | ".join(cells) + f" | {old_cell} | {rep_cell} | "
                         f"{min(loads):.2f}-{max(loads):.2f} | {swaps:.0%}, {stall_t:.2f} / {stall_s:.2f}, "
                         f"{statistics.median(r['copies']['torch_s']):.3f} / "
                         f"{statistics.median(r['copies']['model_s']):.3f} |")
        sim_spread = max((max(x[k] for x in r["sim"]) - min(x[k] for x in r["sim"]))
                         / max(abs(statistics.median(x[k] for x in r["sim"])), 1e-12)
                         for r in m["results"] for k in METRICS)
        lines += ["", (f"The sim's {report['repeats']} runs of each workload differ by at most "
                      f"{sim_spread:.2%} in any of these metrics (it replays exactly).")]
        lines += ["", ("Where the clocks part, on the validation runs' steps (predicted / measured "
                  "total step time per kind of step, recorded-steps profile vs grid profile; the "
                  "engine's own time between back-to-back steps against their step time):"), "",
                  "| workload | prefill-only | mixed | decode-only | engine gap (median ms, share) |",
                  "|---|---|---|---|---|"]
        for r in m["results"]:
            b = r["breakdown"]
            cells = []
            for k in ("prefill", "mixed", "decode"):
                if k in b:
                    cells.append(f"{b[k]['share_of_step_time']:.0%} of time: "
                                 f"{b[k]['recorded_predicted_over_measured']:.2f} vs "
                                 f"{b[k]['grid_predicted_over_measured']:.2f}")
                else:
                    cells.append("-")
            lines.append(f"| {r['case']} | " + " | ".join(cells) +
                         f" | {b['engine_gap_ms_median']:.2f}, {b['engine_gap_over_step_time']:.1%} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "sim_validation.json")
    ap.add_argument("--models", default="tiny,larger")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="runs per side and workload")
    ap.add_argument("--cases", type=lambda v: {int(i) for i in v.split(",")}, default=None,
                    help="only these workloads, by index into CASES (0-based, comma-separated)")
    ap.add_argument("--render", type=Path, default=None, metavar="JSON",
                    help="only write the .md table of an earlier run's JSON")
    args = ap.parse_args()
    if args.render is not None:
        args.render.with_suffix(".md").write_text(markdown(json.loads(args.render.read_text())))
        return
    tmp = Path(tempfile.mkdtemp(prefix="shunter-validation-"))
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    report: dict[str, Any] = {"started": started, "threads": args.threads,
                              "repeats": args.repeats, "tolerance": TOLERANCE, "models": {}}
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
