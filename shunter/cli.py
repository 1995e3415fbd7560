"""`shunter`: the command line. Each subcommand lives in shunter/commands/."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from importlib import metadata

from engine.errors import ShunterError
from engine.logs import configure

COMMANDS = ("make_model", "generate", "demo", "policy", "repl", "bench", "profile", "serve")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless the help already says it or there is
    none to say (None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class Parser(argparse.ArgumentParser):
    """Usage mistakes end in one line, `shunter COMMAND: message`, and exit code 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def version() -> str:
    try:
        return metadata.version("shunter")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def add_verbose(parser: argparse.ArgumentParser, default: object = argparse.SUPPRESS) -> None:
    """`-v` on `parser` and on every subcommand below it, so it may come after the command."""
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="log engine events to stderr; `generate` also reports preemptions "
                             "and swaps")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                add_verbose(child)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="shunter",
        description="Shunter: an LLM serving engine built from actors, scheduled by policy files.")
    parser.add_argument("--version", action="version", version=f"shunter {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"shunter.commands.{name}").add_parser(sub)
    add_verbose(parser, default=False)
    return parser


def configure_logging(verbose: bool) -> None:
    configure(logging.INFO if verbose else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, a usage mistake (already printed)
        return exc.code if isinstance(exc.code, int) else 2
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
