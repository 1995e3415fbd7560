"""Source positions and error reports: `FILE:LINE:COL: message`, the source line, a caret."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence

import attrs

from engine.errors import PolicyCheckError


@attrs.frozen(kw_only=True)
class Span:
    """Where a node came from. Lines and columns count from 1; `end_column` is exclusive;
    `start`/`end` are character offsets into the file's text."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int
    start: int = 0
    end: int = 0

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@attrs.frozen(kw_only=True)
class Diagnostic:
    span: Span
    message: str

    def render(self, sources: Mapping[str, str]) -> str:
        """The report: position and message, then the source line with the span underlined."""
        head = f"{self.span}: {self.message}"
        text = sources.get(self.span.file)
        if text is None:
            return head
        lines = text.splitlines()
        if not 1 <= self.span.line <= len(lines):
            return head
        line = lines[self.span.line - 1].replace("\t", " ")
        start = self.span.column - 1
        end = self.span.end_column - 1 if self.span.end_line == self.span.line else len(line)
        width = max(1, end - start)
        return f"{head}\n  {line}\n  {' ' * start}^{'~' * (width - 1)}"


def render_all(diagnostics: Iterable[Diagnostic], sources: Mapping[str, str]) -> str:
    return "\n".join(d.render(sources) for d in diagnostics)


def check_error(diagnostics: Sequence[Diagnostic], sources: Mapping[str, str], *,
                by_position: bool = True) -> PolicyCheckError:
    """One error for all `diagnostics`, in file and line order unless `by_position` is False."""
    ordered = tuple(diagnostics)
    if by_position:
        ordered = tuple(sorted(ordered, key=lambda d: (d.span.file, d.span.line, d.span.column)))
    return PolicyCheckError(render_all(ordered, sources), diagnostics=ordered)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`; did you mean 'x'?` for the closest choice, or '' when nothing is close."""
    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.7)
    if not close and len(word) >= 3:
        close = [c for c in choices if c.startswith(word) or word.startswith(c)][:1]
    return f"; did you mean '{close[0]}'?" if close else ""


def one_of(choices: Iterable[str]) -> str:
    return ", ".join(sorted(choices))
