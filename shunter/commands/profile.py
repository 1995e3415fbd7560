"""`shunter profile`: the timing profiles of the sim backend.

  shunter profile list                         shipped profile names, one a line
  shunter profile show NAME                    a profile's JSON
  shunter profile fit --model DIR --out F.json measure the torch backend on this machine (CPU
                                               here, the GPU where there is one) and fit one
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.config import EngineConfig
from sim.profile import list_profiles, load_profile, save_profile


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="list, show or fit sim backend timing profiles",
                       description=__doc__)
    acts = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    acts.add_parser("list", help="print the shipped profile names, one a line").set_defaults(run=run_list)
    show = acts.add_parser("show", help="print a profile's JSON")
    show.add_argument("name", help="profile name or JSON file")
    show.set_defaults(run=run_show)
    fit = acts.add_parser("fit", help="measure the torch backend here and fit a profile",
                          description="Time real engine steps (TorchRunner.execute) over a grid of "
                                      "batch shapes and fit the iteration cost model to them.")
    fit.add_argument("--model", type=Path, required=True, help="Hugging Face-format model directory")
    fit.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    fit.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    fit.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    fit.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                     help="weight and KV dtype (auto: float32 on CPU, the model's own on CUDA)")
    fit.add_argument("--threads", type=int, default=None,
                     help="torch CPU threads, fixed for the whole fit (default: one per core)")
    fit.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    fit.add_argument("--max-batched-tokens", type=int, default=512,
                     help="largest prefill chunk measured (the engine's token budget)")
    fit.add_argument("--kv-cache-mib", type=float, default=256.0,
                     help="KV memory the profile's device offers (CPU: the torch backend's default)")
    fit.add_argument("--repeats", type=int, default=3, help="timed repeats per shape (median)")
    fit.add_argument("--workload", action="append", default=[], metavar="SPEC",
                     help="instead of the grid: serve this workload (repeatable) on the torch "
                          "backend, fit on the steps it ran and charge the engine's own time "
                          "between steps (issue 18; bench/sim_validation.py)")
    fit.add_argument("--policy", default="fcfs", help="with --workload: the policy to serve it with")
    fit.add_argument("--no-calibrate", action="store_true",
                     help="fit the steps alone; by default the fit is then calibrated inside a "
                          "running engine (its step slowdown and per-iteration overhead)")
    fit.set_defaults(run=run_fit)


def run_list(args: argparse.Namespace) -> int:
    for name in list_profiles():
        print(name)
    return 0


def run_show(args: argparse.Namespace) -> int:
    print(json.dumps(load_profile(args.name).to_json(), indent=1))
    return 0


def run_fit(args: argparse.Namespace) -> int:
    from gpu.profiler import measure, measure_copy
    from shunter.calibrate import calibrate_in_engine, calibrated, profile_for
    from sim.fit import fit_cost_model

    import torch

    # a fixed count: left open, the runner would tune it while the grid is being timed
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                          threads=args.threads or torch.get_num_threads(),
                          block_size=args.block_size,
                          max_batched_tokens=args.max_batched_tokens)

    def progress(i: int, n: int) -> None:
        print(f"\rmeasuring step times: {i}/{n}", end="", file=sys.stderr, flush=True)

    if args.workload:
        return _fit_on_workloads(args, config)
    rows = measure(config, repeats=args.repeats, on_row=progress)
    print(file=sys.stderr)
    gb_per_s, dispatch_us = measure_copy(args.device)
    name = args.name or args.out.stem
    fit = fit_cost_model(rows, source="")
    if not args.no_calibrate:
        fit = calibrated(fit, *calibrate_in_engine(config, fit.cost))
        print(f"in-engine calibration{fit.note}", file=sys.stderr)
    profile = profile_for(config, name=name, fit=fit, kv_cache_mib=args.kv_cache_mib,
                          gb_per_s=gb_per_s, dispatch_us=dispatch_us)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, args.out)
    held = (f"; mixed batches, held out of the split prefill/decode fit: median error "
            f"{fit.held_out_median_error:.1%} over {fit.held_out_rows}"
            if fit.held_out_median_error is not None else "")
    print(f"wrote {args.out}: {fit.rows} shapes, prediction error median "
          f"{fit.median_relative_error:.1%}, mean {fit.mean_relative_error:.1%} (max "
          f"{fit.max_relative_error:.1%}){held}")
    return 0


def _fit_on_workloads(args: argparse.Namespace, config: EngineConfig) -> int:
    from gpu.profiler import measure_copy
    from shunter.benchmark.policies import parse_policy
    from shunter.fidelity import profile_from_runs, recorded_run
    from shunter.workloads import load_workload

    runs = []
    for spec in args.workload:
        print(f"serving {spec} on the torch backend", file=sys.stderr, flush=True)
        runs.append(recorded_run(parse_policy(args.policy), load_workload(spec), config))
    gb_per_s, dispatch_us = measure_copy(args.device)
    profile, fit = profile_from_runs(config, runs, name=args.name or args.out.stem,
                                     kv_cache_mib=args.kv_cache_mib, gb_per_s=gb_per_s,
                                     dispatch_us=dispatch_us, source=", ".join(args.workload))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, args.out)
    e = profile.engine_cost
    print(f"wrote {args.out}: {fit.rows} recorded steps, prediction error median "
          f"{fit.median_relative_error:.1%}; engine cost {e.per_iteration_ms:.3f} ms per iteration "
          f"+ {e.per_seq_ms:.4f} per sequence + {e.per_sampled_ms:.4f} per sampled token")
    if profile.copy_contention is not None:
        c = profile.copy_contention
        print(f"copies beside the engine: +{c.engine:.2f} ms of its time and +{c.step:.2f} ms of "
              f"step time per ms of copying")
    return 0
