"""`shunter bench`: replay one workload against one or more policies, the same arrivals for
each, and compare TTFT/TBT/TPOT, SLO attainment, goodput, throughput, preemptions and swap
traffic.

The sim backend (default) runs the engine's own actors and policies on a virtual clock with step
times from a GPU profile; the torch backend runs a real model in real time."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.errors import ConfigError
from shunter.commands.cluster_options import add_cluster_options, cluster_fields
from shunter.commands.common import add_step_options, engine_config, non_negative_int, positive_int
from shunter.workloads import Workload, help_text, load_workload


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="replay a trace or synthetic workload against policies and compare them",
        description=__doc__, epilog=help_text() + _POLICY_HELP)
    p.add_argument("--workload", required=True, metavar="SPEC",
                   help="NAME[:key=value,...] or a .toml file (names and keys below)")
    p.add_argument("--policy", action="append", metavar="FILE", dest="policies",
                   help="a .policy file or a policy name, optionally NAME@key=value,... with "
                        "engine settings for that run; repeat to compare (default: fcfs)")
    p.add_argument("--backend", choices=("sim", "torch", "http"), default="sim",
                   help="sim: virtual time, step times from --profile; torch: run --model; "
                        "http: send the requests to the OpenAI-compatible server at --url")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", default="llama3-8b-a100",
                     help="sim profile name (shunter profile list) or JSON file")
    src.add_argument("--model", type=Path, default=None,
                     help="torch backend: Hugging Face-format model directory (default: shipped); "
                          "http: the served model's name (default: the first /v1/models lists)")
    h = p.add_argument_group("http backend")
    h.add_argument("--url", default=None, help="the server's base URL, e.g. http://127.0.0.1:8000")
    h.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    h.add_argument("--vocab", type=positive_int, default=32_000,
                   help="prompt token ids are drawn below this (give the model's "
                        "vocabulary size if it is smaller)")
    p.add_argument("--num-blocks", type=positive_int, default=None,
                   help="device KV blocks (default: from the profile's GPU memory, or kv_cache_mib)")
    p.add_argument("--cpu-swap-blocks", type=non_negative_int, default=None, help="host KV blocks for swapping")
    p.add_argument("--seed", type=int, default=0, help="workload seed unless the spec sets one")
    p.add_argument("--traces", type=Path, default=None,
                   help="folder of the shared traces (default: ../shared/traces from the project)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results here")
    p.add_argument("--plot", type=Path, default=None, metavar="DIR",
                   help="write PNG plots here (needs matplotlib: pip install 'shunter[plot]')")
    g = p.add_argument_group("engine")
    add_step_options(g)
    g.add_argument("--max-queued-requests", type=positive_int, default=100_000,
                   help="admission limit (high: a benchmark measures queueing, not refusals)")
    g.add_argument("--async-backend", default="asyncio", choices=("asyncio", "trio"),
                   help="torch backend's event loop (sim always uses trio's virtual clock)")
    p.add_argument("--sweep", default=None, metavar="KEY=V1,V2,...",
                   help="run every policy at each value of one workload key (e.g. "
                        "rate=0.05,0.1,0.2): one table, --json and --plot (P99 TTFT and "
                        "throughput against the key) for the whole sweep")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_cluster_options(p)
    p.set_defaults(run=run)


_POLICY_HELP = """

policies: --policy takes a .policy file, or a name found as policies/NAME.policy (`fcfs` works
without the policy language); NAME@max_num_seqs=16,max_batched_tokens=1024 runs it with other
engine settings, to compare engine configurations."""


def base_config(args: argparse.Namespace) -> EngineConfig:
    return engine_config(args, backend=args.backend, profile=args.profile,
                         max_queued_requests=args.max_queued_requests, **cluster_fields(args))


def run(args: argparse.Namespace) -> int:
    from shunter.benchmark.checks import check_policies, identical_runs_warning
    from shunter.benchmark.plots import plot_title, require_matplotlib, write_plots
    from shunter.benchmark.policies import parse_policy
    from shunter.benchmark.report import class_table, table
    from shunter.benchmark.run import report_json, run_all

    if args.backend == "http":
        return run_http(args)
    if args.plot:
        require_matplotlib()
    choices = [parse_policy(p) for p in (args.policies or ["fcfs"])]
    check_policies(choices)
    base = base_config(args)
    if args.sweep:
        return run_sweep(args, choices, base)
    workload = _load_workload(args, f"backend {base.backend} "
                                    f"({base.profile if base.backend == 'sim' else base.model})")
    outcomes = run_all(choices, workload, base, async_backend=args.async_backend, cluster=args,
                       progress=not args.quiet)
    print(table(outcomes))
    if (by_class := class_table(outcomes)) is not None:
        print(by_class)
    if (warning := identical_runs_warning(workload, outcomes)) is not None:
        print(warning, file=sys.stderr)
    if args.json:
        _write_json(args.json, report_json(workload, base, outcomes))
    if args.plot:
        for path in write_plots(outcomes, args.plot, plot_title(workload.name, base)):
            print(f"wrote {path}", file=sys.stderr)
    return 1 if any(o.error for o in outcomes) else 0


def run_sweep(args: argparse.Namespace, choices: list, base: EngineConfig) -> int:
    """`--sweep KEY=V1,V2,...`: every policy at every value (shunter/benchmark/sweep.py)."""
    from shunter.benchmark import sweep
    from shunter.benchmark.plots import plot_title
    from shunter.benchmark.run import run_all

    key, values = sweep.parse_sweep(args.sweep)
    rows = sweep.run_sweep(
        key, values, args.workload, choices, base,
        load=lambda spec: _load_workload(argparse.Namespace(**{**vars(args), "workload": spec}),
                                         f"backend {base.backend}"),
        run=lambda cs, w, b: run_all(cs, w, b, async_backend=args.async_backend, cluster=args,
                                     progress=not args.quiet))
    print(sweep.sweep_table(key, rows))
    if args.json:
        _write_json(args.json, {"sweep": {"key": key, "values": values},
                                "workload": args.workload, "rows": rows})
    if args.plot:
        title = f"{plot_title(args.workload.partition(':')[0], base)}, sweep over {key}"
        path = sweep.plot_sweep(key, rows, args.plot / f"sweep_{key}.png", title)
        print(f"wrote {path}", file=sys.stderr)
    return 1 if any("error" in r for r in rows) else 0


def run_http(args: argparse.Namespace) -> int:
    """`--backend http`: the workload against a running server; each --policy is sent to a
    Shunter server through its admin API before its run (none: the server's own policy)."""
    from shunter.benchmark.checks import check_policies
    from shunter.benchmark.http_run import HttpTarget, http_report_json, run_http_all
    from shunter.benchmark.policies import parse_policy
    from shunter.benchmark.report import table

    if not args.url:
        raise ConfigError("--backend http needs --url, the server's base URL")
    if args.plot:
        raise ConfigError("--plot is not available with --backend http (no server-side series)")
    choices = [parse_policy(p) for p in args.policies or ()]
    check_policies(choices)
    target = HttpTarget(url=args.url, api_key=args.api_key, vocab=args.vocab,
                        model=str(args.model) if args.model is not None else None)
    workload = _load_workload(args, f"server {target.url}")
    outcomes = run_http_all(choices, workload, target, async_backend=args.async_backend,
                            progress=not args.quiet)
    print(table(outcomes))
    if args.json:
        _write_json(args.json, http_report_json(workload, target, outcomes))
    return 1 if any(o.error for o in outcomes) else 0


def _load_workload(args: argparse.Namespace, where: str) -> Workload:
    """The workload the spec names, announced on stderr with where it will be served."""
    workload = load_workload(args.workload, traces_dir=args.traces, seed=args.seed)
    d = workload.describe()
    print(f"workload {workload.name}: {d['requests']} requests"
          f"{' + BE batches' if workload.batches else ''}, {d['duration_s']:.0f} s of arrivals; "
          f"{where}", file=sys.stderr)
    return workload


def _write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(report), indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def finite(obj: Any) -> Any:
    """NaN and infinities (a percentile of nothing) become null: the JSON stays standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
