"""Replace one rule of a policy's source text (the REPL's `edit RULE`).

The rule replaces the statement that sets the same thing (`priority rt = ...` replaces
`priority rt = ...`, `preempt never` replaces `preempt ...`); a memory setting replaces only that
setting of the memory block; a rerank written without `every` keeps the schedule it replaces. A
rule the file does not set yet (it may come from the extended policy) is added before the
closing brace. The rest of the text, comments included, is left as it was.
"""

from __future__ import annotations

import re

import attrs

from engine.errors import PolicyError
from policy_lang import ast
from policy_lang.diagnostics import Diagnostic, Span, render_all
from policy_lang.parser import parse, parse_statement

EDIT_FILE = "<edit>"
"""How errors name the text the user typed."""


@attrs.frozen(kw_only=True)
class RuleEdit:
    rule: str
    """The rule as the user typed it (stripped): what errors point into."""
    source: str
    """The policy text with the rule in place."""
    start: int
    """Where the rule's text begins in `source`."""
    origin: tuple[int | None, ...]
    """For each character of the rule's text in `source`, its offset in `rule` (None for text
    the edit added: a kept `every N iterations:`, a merged memory block)."""

    def point_at_rule(self, exc: PolicyError, filename: str) -> str:
        """`exc`'s errors, those inside the rule shown in the rule as typed (`<edit>:1:5`),
        the others in the edited policy text (which is not the file on disk any more)."""
        edited = f"<{filename} as edited>"
        diagnostics = [self._moved(d, filename, edited) for d in getattr(exc, "diagnostics", ())]
        if not diagnostics:
            return str(exc)
        return render_all(diagnostics, {EDIT_FILE: self.rule, edited: self.source})

    def _moved(self, d: Diagnostic, filename: str, edited: str) -> Diagnostic:
        if d.span.file != filename:
            return d
        at = _offset(self.source, d.span.line, d.span.column)
        if not self.start <= at < self.start + len(self.origin):
            return attrs.evolve(d, span=attrs.evolve(d.span, file=edited))
        first = self.origin[at - self.start]
        if first is None:  # text the edit wrote: the whole rule is to blame
            first, width = 0, len(self.rule.split("\n", 1)[0])
        else:
            end = _offset(self.source, d.span.end_line, d.span.end_column)
            width = max(1, min(end, self.start + len(self.origin)) - at)
        line = self.rule.count("\n", 0, first) + 1
        column = first - (self.rule.rfind("\n", 0, first) + 1) + 1
        span = Span(file=EDIT_FILE, line=line, column=column, end_line=line,
                    end_column=column + width, start=first, end=first + width)
        return attrs.evolve(d, span=span)


def _offset(text: str, line: int, column: int) -> int:
    at = 0
    for _ in range(line - 1):
        at = text.find("\n", at) + 1
    return at + column - 1


def _as_written(rule: str) -> tuple[str, tuple[int | None, ...]]:
    """A one-line rule with its spaces collapsed; a rule of several lines as typed."""
    if "\n" in rule:
        return rule, tuple(range(len(rule)))
    text, origin = "", []
    for word in re.finditer(r"\S+", rule):
        if text:
            text += " "
            origin.append(word.start() - 1)
        text += word.group()
        origin.extend(range(word.start(), word.end()))
    return text, tuple(origin)


def replace_rule(source: str, rule: str, *, filename: str = "<running>") -> str:
    """`source` with `rule` in place of the statement it overrides; raises PolicySyntaxError
    when either does not parse."""
    return edit_rule(source, rule, filename=filename).source


def edit_rule(source: str, rule: str, *, filename: str = "<running>") -> RuleEdit:
    """`replace_rule`, keeping where the rule went so that errors can point into it."""
    rule = rule.strip()
    tree = parse(source, filename)
    stmt = parse_statement(rule, EDIT_FILE)
    text, origin = _as_written(rule)
    keys = set(ast.rule_keys(stmt))
    old = next((s for s in tree.body if keys & set(ast.rule_keys(s))), None) if keys else None
    if old is None:
        new, start = _insert(source, tree, text)
        return RuleEdit(rule=rule, source=new, start=start, origin=origin)
    if isinstance(stmt, ast.Memory) and isinstance(old, ast.Memory):
        text = _merge_memory(source, old, stmt)
        origin = (None,) * len(text)
    elif isinstance(stmt, ast.Rerank) and stmt.schedule is None and isinstance(old, ast.Rerank) \
            and old.schedule is not None:
        kept = f"{_slice(source, old.schedule)}: "
        text, origin = kept + text, (None,) * len(kept) + origin
    new = source[:old.span.start] + text + source[old.span.end:]
    return RuleEdit(rule=rule, source=new, start=old.span.start, origin=origin)


def _slice(source: str, node: ast.Node) -> str:
    return source[node.span.start:node.span.end]


def _merge_memory(source: str, old: ast.Memory, new: ast.Memory) -> str:
    values = {s.name.name: s.value.name for s in old.settings}
    values.update({s.name.name: s.value.name for s in new.settings})
    return "memory { " + "; ".join(f"{k} {v}" for k, v in values.items()) + " }"


def _insert(source: str, tree: ast.PolicyFile, text: str) -> tuple[str, int]:
    """The source with `text` added as a statement of its own, and where `text` begins."""
    if tree.close is None:
        head = source.rstrip("\n") + "\n"
        return head + text + "\n", len(head)
    at = tree.close.start
    line_start = source.rfind("\n", 0, at) + 1
    if source[line_start:at].strip():
        head = source[:at].rstrip(" ") + " "
        return head + f"{text} " + source[at:], len(head)
    head = source[:line_start] + "  "
    return head + f"{text}\n" + source[line_start:], len(head)
