"""`shunter`: the command line. Each subcommand lives in shunter/commands/."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from engine.errors import ShunterError
from engine.logs import configure

COMMANDS = ("make_model", "generate", "demo", "policy", "repl", "bench", "profile", "serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shunter",
        description="Shunter: an LLM serving engine built from actors, scheduled by policy files.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine events to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"shunter.commands.{name}").add_parser(sub)
    return parser


def configure_logging(verbose: bool) -> None:
    configure(logging.INFO if verbose else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        return args.run(args)
    except ShunterError as exc:
        print(f"shunter {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
