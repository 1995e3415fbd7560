"""The REPL's terminal front: readline line editing, a history file, and tab completion of
commands, shipped policy names, policy keywords, field names and the running policy's classes."""

from __future__ import annotations

import glob
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from engine.errors import ShunterError
from policies import available
from policy_lang.fields import FIELDS
from shunter.repl.session import COMMANDS, ReplSession

PROMPT = "shunter> "
EDIT_WORDS = (
    "class", "default", "priority", "precedence", "alternate", "every", "frequency", "rerank",
    "markov", "random", "stay", "seed", "iterations", "fair", "tenant", "input", "output", "pack",
    "while", "fill", "replaces", "when", "batch", "max", "adaptive", "start", "grow", "reset_on",
    "violation", "predicted", "observed", "preempt", "swap", "recompute", "never", "displace",
    "overload", "drop", "restore", "for", "memory", "swap_granularity", "per-block", "groups",
    "swap_in", "sync", "async", "kv_reuse", "on", "off", "asc", "desc", "and", "or", "not",
    "ttft", "tpot", "max_running", "max_queued", "min", "abs",
)


class Completer:
    """readline completer: the first word is a command; later words depend on it."""

    def __init__(self, session: ReplSession) -> None:
        self.session = session
        self._matches: list[str] = []

    def words(self, line: str) -> list[str]:
        command = line.split(" ", 1)[0] if " " in line else ""
        if not command:
            return list(COMMANDS)
        if command == "workload":
            return ["pause", "resume", "rate"]
        if command == "load":
            return available()
        if command == "edit":
            try:
                classes = list(self.session.backend.policy().classes)
            except ShunterError:  # the server went away: complete without its classes
                classes = []
            return sorted(set(EDIT_WORDS) | set(FIELDS) | set(classes))
        return []

    def complete(self, text: str, state: int) -> str | None:
        if state == 0:
            import readline  # optional; only readline itself calls this, so it is there

            line = readline.get_line_buffer()[:readline.get_begidx()]
            words = self.words(line)
            self._matches = [w for w in words if w.startswith(text)]
            if line.startswith("load "):
                self._matches += [p + ("/" if Path(p).is_dir() else "") for p in glob.glob(text + "*")]
            self._matches = [m if m.endswith("/") else m + " " for m in self._matches]
        return self._matches[state] if state < len(self._matches) else None


def run_terminal(session: ReplSession, *, history: Path | None,
                 read: Callable[[str], str] = input, out: TextIO | None = None) -> None:
    """Read commands until `quit` or end of input, printing each command's answer."""
    out = out or sys.stdout
    readline = _setup_readline(session, history)
    print("shunter repl: type help for the commands, quit to leave", file=out)
    try:
        while not session.done:
            try:
                line = read(PROMPT)
            except EOFError:
                print(file=out)
                break
            except KeyboardInterrupt:
                print("^C", file=out)
                continue
            answer = session.execute(line)
            if answer:
                print(answer, file=out, flush=True)
    finally:
        if readline is not None and history is not None:
            try:
                readline.write_history_file(history)
            except OSError:
                pass


def _setup_readline(session: ReplSession, history: Path | None):
    try:
        import readline
    except ImportError:  # pragma: no cover - no readline on this platform
        return None
    readline.set_completer(Completer(session).complete)
    readline.set_completer_delims(" \t\n=(),;{}")
    readline.parse_and_bind("tab: complete")
    readline.set_history_length(1000)
    if history is not None and history.exists():
        try:
            readline.read_history_file(history)
        except OSError:
            pass
    return readline
