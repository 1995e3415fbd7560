"""`shunter repl`: start an engine in-process with a small synthetic workload of real-time and
best-effort requests, watch its queues and SLO attainment, and show, load, edit, diff and roll
back its policy while it serves."""

from __future__ import annotations

import argparse
from pathlib import Path

from shunter.commands.common import add_engine_options, engine_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("repl", help="interactive prompt: watch an engine serve and edit its policy",
                       description=__doc__)
    p.add_argument("--rate", type=float, default=4.0,
                   help="workload arrivals per second (default 4; `workload rate N` changes it)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--max-in-flight", type=int, default=32,
                   help="most workload requests in the engine at once")
    p.add_argument("--history", type=Path, default=Path.home() / ".shunter_history",
                   help="readline history file (default ~/.shunter_history)")
    add_engine_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from shunter.repl.session import open_session
    from shunter.repl.terminal import run_terminal

    config = engine_config(args)
    print(f"starting the engine on {config.model} ...", flush=True)
    with open_session(config, rate=args.rate, seed=args.seed, max_in_flight=args.max_in_flight,
                      async_backend=args.async_backend) as session:
        run_terminal(session, history=args.history)
    return 0
