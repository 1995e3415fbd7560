"""Text to syntax tree: a cached LALR parser over grammar.lark and a Transformer that builds the
attrs nodes of policy_lang/ast.py. Lark's errors become `PolicySyntaxError`s that point at the
offending token (or at the `{` that was never closed)."""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from lark.lexer import PatternStr

from engine.errors import PolicySyntaxError
from policy_lang import ast
from policy_lang.diagnostics import Diagnostic, Span, did_you_mean
from policy_lang.fields import UNIT_TYPES

STATEMENT_KEYWORDS = ("alternate", "batch", "class", "default", "dispatch", "every", "fair", "frequency",
                      "include", "memory", "overload", "pack", "precedence", "preempt",
                      "prefill", "priority", "rerank")


@functools.cache
def _lark() -> Lark:
    grammar = resources.files("policy_lang").joinpath("grammar.lark").read_text()
    return Lark(grammar, parser="lalr", lexer="contextual", propagate_positions=True,
                maybe_placeholders=False, start=["start", "fragment"])


def parse(text: str, filename: str = "<string>") -> ast.PolicyFile:
    """Parse a whole file (a policy or a fragment)."""
    try:
        tree = _lark().parse(text, start="start")
    except UnexpectedInput as exc:
        raise _syntax_error(exc, text, filename) from None
    return _Build(filename, text).transform(tree)


def parse_statement(text: str, filename: str = "<edit>") -> ast.Statement:
    """Parse exactly one statement (the REPL's `edit RULE`)."""
    try:
        tree = _lark().parse(text, start="fragment")
    except UnexpectedInput as exc:
        raise _syntax_error(exc, text, filename) from None
    body = _Build(filename, text).transform(tree).body
    statements = [s for s in body if s is not None]
    if len(statements) != 1:
        span = Span(file=filename, line=1, column=1, end_line=1, end_column=len(text) + 1)
        diag = Diagnostic(span=span, message=f"expected one rule, got {len(statements)}")
        raise PolicySyntaxError(diag.render({filename: text}), diagnostics=(diag,))
    return statements[0]


# --------------------------------------------------------------------------------- errors


def _terminal_text(name: str) -> str:
    if name == "$END":
        return "end of file"
    if name in ("NAME", "NUMBER", "STRING"):
        return {"NAME": "a name", "NUMBER": "a number", "STRING": 'a "string"'}[name]
    try:
        pattern = _lark().get_terminal(name).pattern
    except KeyError:
        return name
    return f"'{pattern.value}'" if isinstance(pattern, PatternStr) else name


def _expected(names: set[str]) -> str:
    texts = {_terminal_text(n) for n in names}
    keywords = {f"'{k}'" for k in STATEMENT_KEYWORDS}
    if keywords <= texts:
        texts = (texts - keywords) | {"a statement"}
    return ", ".join(sorted(texts))


def _syntax_error(exc: UnexpectedInput, text: str, filename: str) -> PolicySyntaxError:
    diag = _diagnose(exc, text, filename)
    return PolicySyntaxError(diag.render({filename: text}), diagnostics=(diag,))


def _diagnose(exc: UnexpectedInput, text: str, filename: str) -> Diagnostic:
    if isinstance(exc, UnexpectedToken) and exc.token.type == "$END":
        return _end_of_file(exc, text, filename)
    line, column = exc.line, exc.column
    if isinstance(exc, UnexpectedCharacters):
        span = Span(file=filename, line=line, column=column, end_line=line, end_column=column + 1)
        return Diagnostic(span=span, message=f"unexpected character {text[exc.pos_in_stream]!r}")
    assert isinstance(exc, UnexpectedToken)
    tok: Token = exc.token
    span = Span(file=filename, line=line, column=column, end_line=tok.end_line or line,
                end_column=tok.end_column or column + len(tok))
    expected = exc.accepts or exc.expected
    word = str(tok)
    if word.isidentifier():
        choices = [_terminal_text(n).strip("'") for n in expected]
        hint = did_you_mean(word, [c for c in choices if c.isidentifier()])
        if hint:
            return Diagnostic(span=span, message=f"unexpected '{word}'{hint}")
    shown = f"'{word}'" if tok.type != "NAME" else f"name '{word}'"
    message = f"unexpected {shown}; expected {_expected(expected)}"
    if word in STATEMENT_KEYWORDS and "RBRACE" in expected:
        message += " (is a '}' missing before it?)"
    elif tok.type == "NAME" and text[:tok.start_pos].rstrip()[-1:].isdigit():
        message += f" (a number's unit is one of: {', '.join(u for u in UNIT_TYPES if u)})"
    return Diagnostic(span=span, message=message)


def _end_of_file(exc: UnexpectedToken, text: str, filename: str) -> Diagnostic:
    brace = _unclosed_brace(text)
    if brace is not None:
        line, column = _line_col(text, brace)
        span = Span(file=filename, line=line, column=column, end_line=line, end_column=column + 1,
                    start=brace, end=brace + 1)
        return Diagnostic(span=span, message="this '{' is never closed (the file ends first)")
    line, column = _line_col(text, len(text.rstrip()))
    span = Span(file=filename, line=line, column=column, end_line=line, end_column=column + 1)
    expected = exc.accepts or exc.expected
    return Diagnostic(span=span, message=f"unexpected end of file; expected {_expected(expected)}")


def _unclosed_brace(text: str) -> int | None:
    """Offset of the innermost '{' still open at the end of `text`, skipping comments and
    strings."""
    stack: list[int] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c == '"':
            i += 1
            while i < n and text[i] not in '"\n':
                i += 1
        elif c == "{":
            stack.append(i)
        elif c == "}" and stack:
            stack.pop()
        i += 1
    return stack[-1] if stack else None


def _line_col(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


# ------------------------------------------------------------------------------ transformer


@v_args(meta=True)
class _Build(Transformer):
    """Lark tree -> ast nodes. Every node gets the span of the text it covers."""

    def __init__(self, filename: str, text: str) -> None:
        super().__init__()
        self.filename = filename
        self.text = text

    def _span(self, meta: Any) -> Span:
        if getattr(meta, "empty", True):
            return Span(file=self.filename, line=1, column=1, end_line=1, end_column=1)
        return Span(file=self.filename, line=meta.line, column=meta.column,
                    end_line=meta.end_line, end_column=meta.end_column,
                    start=meta.start_pos, end=meta.end_pos)

    def _tok(self, tok: Token) -> Span:
        return Span(file=self.filename, line=tok.line, column=tok.column, end_line=tok.end_line,
                    end_column=tok.end_column, start=tok.start_pos, end=tok.end_pos)

    def _ident(self, tok: Token) -> ast.Ident:
        return ast.Ident(span=self._tok(tok), name=str(tok))

    def _string(self, tok: Token) -> ast.String:
        return ast.String(span=self._tok(tok), value=str(tok)[1:-1])

    # files and statements

    def start(self, meta, children):
        return children[0]

    def policy(self, meta, children):
        name, rest = children[0], children[1:]
        extends = None
        if rest and isinstance(rest[0], Token) and rest[0].type == "STRING":
            extends, rest = self._string(rest[0]), rest[1:]
        span = self._span(meta)
        close = Span(file=self.filename, line=meta.end_line, column=meta.end_column - 1,
                     end_line=meta.end_line, end_column=meta.end_column,
                     start=meta.end_pos - 1, end=meta.end_pos)
        return ast.PolicyFile(span=span, name=self._ident(name), extends=extends,
                              body=_statements(rest), close=close)

    def fragment(self, meta, children):
        return ast.PolicyFile(span=self._span(meta), name=None, extends=None,
                              body=_statements(children))

    def include(self, meta, children):
        return ast.Include(span=self._span(meta), path=self._string(children[0]))

    def class_name(self, meta, children):
        return self._ident(children[0])

    def setting(self, meta, children):
        return ast.Setting(span=self._span(meta), name=self._ident(children[0]), value=children[1])

    def class_decl(self, meta, children):
        return ast.ClassDecl(span=self._span(meta), name=children[0], settings=tuple(children[1:]))

    def default_class(self, meta, children):
        return ast.DefaultClass(span=self._span(meta), name=children[0])

    def direction(self, meta, children):
        return str(children[0])

    def sort_key(self, meta, children):
        descending = len(children) > 1 and children[1] == "desc"
        return ast.SortKey(span=self._span(meta), expr=children[0], descending=descending)

    def priority_rule(self, meta, children):
        cls = children[0] if isinstance(children[0], ast.Ident) else None
        keys = tuple(children[1:] if cls else children)
        return ast.PriorityRule(span=self._span(meta), cls=cls, keys=keys)

    def precedence(self, meta, children):
        return ast.Precedence(span=self._span(meta), classes=tuple(children))

    def alternate(self, meta, children):
        return ast.Alternate(span=self._span(meta), classes=tuple(children))

    def every(self, meta, children):
        return ast.Schedule(span=self._span(meta), kind="every", amount=children[0])

    def frequency(self, meta, children):
        return ast.Schedule(span=self._span(meta), kind="frequency", amount=children[0])

    def rerank(self, meta, children):
        schedule = children[0] if len(children) == 2 else None
        return ast.Rerank(span=self._span(meta), schedule=schedule, pattern=children[-1])

    def fair(self, meta, children):
        return ast.Fair(span=self._span(meta), subject=self._ident(children[0]),
                        settings=tuple(children[1:]))

    def pack(self, meta, children):
        return ast.Pack(span=self._span(meta), steps=tuple(c for c in children if c is not None))

    def take(self, meta, children):
        return ast.Take(span=self._span(meta), cls=children[0], cond=children[1])

    def fill(self, meta, children):
        cond = children[1] if len(children) > 1 else None
        return ast.Fill(span=self._span(meta), cls=children[0], cond=cond)

    def replace(self, meta, children):
        return ast.Replace(span=self._span(meta), cls=children[0], victim=children[1],
                           cond=children[2])

    def batch_max(self, meta, children):
        return ast.BatchMax(span=self._span(meta), limit=children[0])

    def batch_adaptive(self, meta, children):
        return ast.BatchAdaptive(span=self._span(meta), args=tuple(children))

    def prefill(self, meta, children):
        return ast.Prefill(span=self._span(meta), mode=self._ident(children[0]),
                           args=tuple(children[1:]))

    def preempt(self, meta, children):
        short = [c for c in children[1:] if isinstance(c, ast.Ident)]
        return ast.Preempt(span=self._span(meta), mode=self._ident(children[0]),
                           displace=any(isinstance(c, Token) and c.type == "DISPLACE"
                                        for c in children[1:]),
                           short_of_block=short[0] if short else None)

    def short_of_block(self, meta, children):
        return self._ident(children[0])

    def overload(self, meta, children):
        hold = children[2] if len(children) > 2 else None
        return ast.Overload(span=self._span(meta), action=self._ident(children[0]),
                            cond=children[1], hold=hold)

    def dispatch(self, meta, children):
        return ast.Dispatch(span=self._span(meta), rule=self._ident(children[0]))

    def memory(self, meta, children):
        return ast.Memory(span=self._span(meta), settings=tuple(children))

    def mem_setting(self, meta, children):
        return ast.MemSetting(span=self._span(meta), name=self._ident(children[0]), value=children[1])

    def word(self, meta, children):
        return ast.Ident(span=self._span(meta), name="-".join(str(c) for c in children))

    # expressions

    def _fold(self, meta, children, op: str):
        node = children[0]
        for right in children[1:]:
            node = ast.BinOp(span=self._join(node.span, right.span), op=op, left=node, right=right)
        return node

    def _join(self, a: Span, b: Span) -> Span:
        return Span(file=a.file, line=a.line, column=a.column, end_line=b.end_line,
                    end_column=b.end_column, start=a.start, end=b.end)

    def or_expr(self, meta, children):
        return self._fold(meta, children, "or")

    def and_expr(self, meta, children):
        return self._fold(meta, children, "and")

    def _chain(self, meta, children):
        node = children[0]
        for i in range(1, len(children), 2):
            right = children[i + 1]
            node = ast.BinOp(span=self._join(node.span, right.span), op=children[i], left=node,
                             right=right)
        return node

    comparison = sum = product = _chain

    def comp_op(self, meta, children):
        return str(children[0])

    add_op = mul_op = comp_op

    def not_(self, meta, children):
        return ast.Not(span=self._span(meta), operand=children[0])

    def neg(self, meta, children):
        return ast.Neg(span=self._span(meta), operand=children[0])

    def string(self, meta, children):
        return self._string(children[0])

    def name(self, meta, children):
        return ast.Name(span=self._tok(children[0]), name=str(children[0]))

    def class_field(self, meta, children):
        return ast.Name(span=self._span(meta), name="class")

    def call(self, meta, children):
        return ast.Call(span=self._span(meta), func=self._ident(children[0]),
                        args=tuple(children[1:]))

    def arg(self, meta, children):
        if len(children) == 2:
            return ast.Arg(span=self._span(meta), name=self._ident(children[0]), value=children[1])
        return ast.Arg(span=self._span(meta), name=None, value=children[0])

    def unit(self, meta, children):
        return str(children[0])

    def number(self, meta, children):
        unit = children[1] if len(children) > 1 else None
        return ast.Number(span=self._span(meta), value=float(children[0]), unit=unit)


def _statements(children: list) -> tuple[ast.Statement, ...]:
    """Drop the empty statements (a stray `;`)."""
    return tuple(c for c in children if not isinstance(c, Token) and c is not None)
