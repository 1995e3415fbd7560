"""Torch-vs-sim validation: fit a profile for a tiny model on this machine, replay the same
workload on the torch backend (real time) and on the sim backend (virtual time, the fitted
profile), and report how far apart TTFT p50/p99 and throughput are (issue 4: within 20%).

    python bench/sim_validation.py [--out bench/results/sim_validation.json] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu.make_model import write_random_model  # noqa: E402
from gpu.profiler import measure, measure_copy  # noqa: E402
from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy  # noqa: E402
from shunter.benchmark.run import run_one  # noqa: E402
from shunter.calibrate import calibrate_in_engine, calibrated, profile_for  # noqa: E402
from shunter.workloads import load_workload  # noqa: E402
from sim.fit import fit_cost_model  # noqa: E402
from sim.profile import save_profile  # noqa: E402

MODEL = dict(arch="llama", layers=4, hidden=256, heads=8, kv_heads=4, vocab=4096, seed=0)
WORKLOADS = ("sharegpt:requests=60,rate=3,scale_lengths=0.05",
             "sharegpt:requests=80,rate=12,scale_lengths=0.05",
             "multiturn:conversations=12,rate=1,think=1,scale_lengths=0.05")


def gap(torch_v: float, sim_v: float) -> float:
    """Relative difference of the sim from the torch measurement."""
    return (sim_v - torch_v) / torch_v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sim_validation.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="torch runs per workload (median)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="shunter-validation-"))
    model = write_random_model(tmp / "model", **MODEL)
    torch_cfg = EngineConfig(model=model, device="cpu", threads=args.threads)
    began = time.perf_counter()
    fit = fit_cost_model(measure(torch_cfg, repeats=3), source="")
    k, overhead_ms, per_seq_ms = calibrate_in_engine(torch_cfg, fit.cost)
    fit = calibrated(fit, k, overhead_ms, per_seq_ms)
    gbps, dispatch = measure_copy("cpu")
    profile = profile_for(torch_cfg, name="tiny-cpu", fit=fit, kv_cache_mib=torch_cfg.kv_cache_mib,
                          gb_per_s=gbps, dispatch_us=dispatch)
    save_profile(profile, tmp / "tiny-cpu.json")
    fit_s = time.perf_counter() - began
    sim_cfg = EngineConfig(backend="sim", profile=str(tmp / "tiny-cpu.json"))
    results = []
    for spec in WORKLOADS:
        w = load_workload(spec, seed=0)
        runs = {}
        for name, cfg in (("torch", torch_cfg), ("sim", sim_cfg)):
            reps = []
            # real time on a shared 2-core machine is noisy: the median of a few torch runs
            for _ in range(args.repeats if name == "torch" else 1):
                o = run_one(parse_policy("fcfs"), w, cfg, progress=False)
                if o.error:
                    sys.exit(f"{spec} on {name}: {o.error}")
                m = o.metrics
                reps.append({"ttft_p50_ms": m.ttft_ms.p50, "ttft_p99_ms": m.ttft_ms.p99,
                             "tpot_p50_ms": m.tpot_ms.p50,
                             "output_tokens_per_s": m.output_tokens_per_s,
                             "duration_s": m.duration_s, "iterations": m.iterations,
                             "completed": m.completed, "wall_s": o.wall_s})
            runs[name] = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
            if len(reps) > 1:
                runs[name]["each_run"] = reps
        t, s = runs["torch"], runs["sim"]
        diff = {k: gap(t[k], s[k]) for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                                              "output_tokens_per_s")}
        results.append({"workload": spec, "torch": t, "sim": s, "relative_difference": diff})
        print(spec, json.dumps({k: f"{v:+.1%}" for k, v in diff.items()}), flush=True)
    report = {"load_average_at_end": os.getloadavg(),
              "note": "torch runs are real time on a shared 2-core machine: other processes "
                      "(tests, training) move them by tens of percent; see bench/results/NOTES.md",
              "model": MODEL, "threads": args.threads, "torch_repeats": args.repeats, "profile": profile.to_json(),
              "fit": {"rows": fit.rows, "mean_relative_error": fit.mean_relative_error,
                      "in_engine_step_factor": k, "in_engine_overhead_ms": overhead_ms,
                      "in_engine_overhead_ms_per_seq": per_seq_ms,
                      "max_relative_error": fit.max_relative_error, "seconds": fit_s},
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
