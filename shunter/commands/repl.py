"""`shunter repl`: start an engine in-process with a small synthetic workload of real-time and
best-effort requests, watch its queues and SLO attainment, and show, load, edit, diff and roll
back its policy while it serves. With `--connect URL`, the same commands drive a running
`shunter serve` through its admin routes."""

from __future__ import annotations

import argparse
from pathlib import Path

from shunter.commands.common import add_engine_options, engine_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("repl", help="interactive prompt: watch an engine serve and edit its policy",
                       description=__doc__)
    p.add_argument("--rate", type=float, default=4.0,
                   help="workload arrivals per second (`workload rate N` changes it)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--max-in-flight", type=int, default=32,
                   help="most workload requests in the engine at once")
    p.add_argument("--history", type=Path, default=Path.home() / ".shunter_history",
                   help="history file (default: ~/.shunter_history)")
    p.add_argument("--connect", metavar="URL",
                   help="drive a running server (shunter serve) instead of an in-process engine")
    p.add_argument("--api-key", metavar="KEY", help="the server's API key, with --connect")
    add_engine_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from shunter.repl.session import connect_session, open_session
    from shunter.repl.terminal import run_terminal

    if args.connect:
        with connect_session(args.connect, api_key=args.api_key) as session:
            print(f"connected to {args.connect}", flush=True)
            run_terminal(session, history=args.history)
        return 0
    config = engine_config(args)
    print(f"starting the engine on {config.model} ...", flush=True)
    with open_session(config, rate=args.rate, seed=args.seed, max_in_flight=args.max_in_flight,
                      async_backend=args.async_backend) as session:
        run_terminal(session, history=args.history)
    return 0
