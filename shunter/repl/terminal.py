"""The REPL's terminal front, on prompt_toolkit: line editing, a history file, completion of
commands, shipped policy names, policy keywords, field names and the running policy's classes,
and multi-line rules (`edit` alone). Without a terminal (commands piped in, as the tests and
scripts drive it) it reads plain lines: prompt_toolkit needs a terminal to run."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion, PathCompleter
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent

from engine.errors import ShunterError
from policies import available
from policy_lang.fields import FIELDS
from shunter.repl.session import COMMANDS, ReplSession

PROMPT = "shunter> "
MORE = "   ...> "
"""The prompt of each line of a multi-line rule."""
EDIT_WORDS = (
    "class", "default", "priority", "precedence", "alternate", "every", "frequency", "rerank",
    "markov", "random", "stay", "seed", "iterations", "fair", "tenant", "input", "output", "pack",
    "while", "fill", "replaces", "when", "batch", "max", "adaptive", "start", "grow", "reset_on",
    "violation", "predicted", "observed", "preempt", "swap", "recompute", "never", "displace",
    "overload", "drop", "restore", "for", "memory", "swap_granularity", "per-block", "groups",
    "swap_in", "sync", "async", "kv_reuse", "on", "off", "asc", "desc", "and", "or", "not",
    "ttft", "tpot", "max_running", "max_queued", "min", "abs",
)
SEPARATORS = " \t\n=(),;{}"


class CommandCompleter(Completer):
    """The first word is a command; later words depend on it (a multi-line rule, whose
    buffer has no command, completes as `edit`)."""

    def __init__(self, session: ReplSession, *, rule: bool = False) -> None:
        self.session = session
        self.rule = rule
        self._paths = PathCompleter(expanduser=True)

    def words(self, before: str) -> list[str]:
        command = "edit" if self.rule else before.split(" ", 1)[0] if " " in before else ""
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

    def get_completions(self, document: Document,
                        event: CompleteEvent) -> Iterable[Completion]:
        before = document.text_before_cursor
        start = max(before.rfind(c) for c in SEPARATORS) + 1
        word, head = before[start:], before[:start]
        for w in self.words(head):
            if w.startswith(word):
                yield Completion(w + " ", start_position=-len(word), display=w)
        if head.startswith("load "):
            yield from self._paths.get_completions(Document(word), event)


def _tab_key(keys: KeyBindings) -> KeyBindings:
    """Tab completes at once when one word fits (prompt_toolkit completes in a background task,
    which an Enter typed right after would overtake); otherwise it opens the menu."""

    @keys.add("tab")
    def _(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        completer = buffer.completer
        if completer is None:
            return
        found = list(completer.get_completions(buffer.document,
                                               CompleteEvent(completion_requested=True)))
        if len(found) == 1:
            buffer.apply_completion(found[0])
        elif found:
            buffer.start_completion(insert_common_part=True)

    return keys


def _rule_keys() -> KeyBindings:
    """Enter on a blank line ends a multi-line rule (Esc Enter ends it anywhere)."""
    keys = KeyBindings()

    @keys.add("enter")
    def _(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        if not buffer.document.current_line.strip() and buffer.document.is_cursor_at_the_end:
            buffer.text = buffer.text.rstrip()
            buffer.validate_and_handle()
        else:
            buffer.newline(copy_margin=False)

    return _tab_key(keys)


def _history(path: Path | None) -> History:
    if path is None:
        return InMemoryHistory()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:  # a read-only home: keep this session's history in memory
        return InMemoryHistory()
    return FileHistory(str(path))


class TerminalInput:
    """Commands typed at the terminal; `edit` alone reads a rule of several lines."""

    def __init__(self, session: ReplSession, history: Path | None) -> None:
        self.prompt = PromptSession(history=_history(history), completer=CommandCompleter(session),
                                    complete_while_typing=False, key_bindings=_tab_key(KeyBindings()))
        self.rule = PromptSession(completer=CommandCompleter(session, rule=True),
                                  complete_while_typing=False, key_bindings=_rule_keys(),
                                  multiline=True, prompt_continuation=MORE)

    def __call__(self) -> str:
        """The next command; raises EOFError at Ctrl-D, KeyboardInterrupt at Ctrl-C."""
        line = self.prompt.prompt(PROMPT)
        if line.strip() != "edit":
            return line
        print("type the rule; a blank line (or Esc Enter) applies it, Ctrl-C drops it",
              flush=True)
        try:
            text = self.rule.prompt(MORE)
        except KeyboardInterrupt:
            return "# dropped"
        if text.strip():
            self.prompt.history.append_string(f"edit {' '.join(text.split())}")
        return f"edit {text}"


class PipedInput:
    """Commands read from a pipe or a file; after `edit` alone, the rule's lines up to a blank
    line or the end."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def _line(self) -> str:
        line = self.stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    def __call__(self) -> str:
        line = self._line()
        if line.strip() != "edit":
            return line
        rule = []
        try:
            while (more := self._line()).strip():
                rule.append(more)
        except EOFError:
            pass
        return "edit " + "\n".join(rule)


def run_terminal(session: ReplSession, *, history: Path | None, stdin: TextIO | None = None,
                 out: TextIO | None = None) -> None:
    """Read commands until `quit` or end of input, printing each command's answer."""
    stdin, out = stdin or sys.stdin, out or sys.stdout
    interactive = stdin.isatty() and out.isatty()
    read = TerminalInput(session, history) if interactive else PipedInput(stdin)
    print("shunter repl: type help for the commands, quit to leave", file=out, flush=True)
    while not session.done:
        try:
            line = read()
        except EOFError:  # Ctrl-D, or the end of the piped commands
            print(file=out)
            break
        except KeyboardInterrupt:
            print("^C", file=out)
            continue
        answer = session.execute(line)
        if answer:
            print(answer, file=out, flush=True)
