"""The syntax tree of a policy file: frozen attrs nodes, each with the span it came from."""

from __future__ import annotations

from typing import Literal, Union

import attrs

from policy_lang.diagnostics import Span


@attrs.frozen(kw_only=True)
class Node:
    span: Span


@attrs.frozen(kw_only=True)
class Ident(Node):
    """A name in a statement's fixed position: a class, a setting, a mode."""

    name: str


# ---------------------------------------------------------------------------- expressions


@attrs.frozen(kw_only=True)
class Number(Node):
    value: float
    """As written (400 for `400ms`, 2 for `2s`, 95 for `95%`)."""
    unit: str | None


@attrs.frozen(kw_only=True)
class String(Node):
    value: str


@attrs.frozen(kw_only=True)
class Name(Node):
    """A field (`slack`, `kv_usage`) or a symbol an argument accepts (`violation`)."""

    name: str


@attrs.frozen(kw_only=True)
class BinOp(Node):
    op: str
    """`+ - * / < <= > >= == != and or`"""
    left: Expr
    right: Expr


@attrs.frozen(kw_only=True)
class Not(Node):
    operand: Expr


@attrs.frozen(kw_only=True)
class Neg(Node):
    operand: Expr


@attrs.frozen(kw_only=True)
class Arg(Node):
    name: Ident | None
    value: Expr


@attrs.frozen(kw_only=True)
class Call(Node):
    func: Ident
    args: tuple[Arg, ...]


Expr = Union[Number, String, Name, BinOp, Not, Neg, Call]

# ----------------------------------------------------------------------------- statements


@attrs.frozen(kw_only=True)
class Include(Node):
    path: String


@attrs.frozen(kw_only=True)
class Setting(Node):
    name: Ident
    value: Expr


@attrs.frozen(kw_only=True)
class ClassDecl(Node):
    name: Ident
    settings: tuple[Setting, ...]


@attrs.frozen(kw_only=True)
class DefaultClass(Node):
    name: Ident


@attrs.frozen(kw_only=True)
class SortKey(Node):
    expr: Expr
    descending: bool


@attrs.frozen(kw_only=True)
class PriorityRule(Node):
    cls: Ident | None
    """None: the rule of every class without its own."""
    keys: tuple[SortKey, ...]


@attrs.frozen(kw_only=True)
class Precedence(Node):
    classes: tuple[Ident, ...]


@attrs.frozen(kw_only=True)
class Alternate(Node):
    classes: tuple[Ident, ...]


@attrs.frozen(kw_only=True)
class Schedule(Node):
    kind: Literal["every", "frequency"]
    amount: Expr


@attrs.frozen(kw_only=True)
class Rerank(Node):
    schedule: Schedule | None
    """None: keep the schedule of the rerank this one overrides."""
    pattern: Call


@attrs.frozen(kw_only=True)
class Fair(Node):
    subject: Ident
    settings: tuple[Setting, ...]


@attrs.frozen(kw_only=True)
class Take(Node):
    cls: Ident
    cond: Expr


@attrs.frozen(kw_only=True)
class Fill(Node):
    cls: Ident
    cond: Expr | None


@attrs.frozen(kw_only=True)
class Replace(Node):
    cls: Ident
    victim: Ident
    cond: Expr


PackStep = Union[Take, Fill, Replace]


@attrs.frozen(kw_only=True)
class Pack(Node):
    steps: tuple[PackStep, ...]


@attrs.frozen(kw_only=True)
class BatchMax(Node):
    limit: Expr


@attrs.frozen(kw_only=True)
class BatchAdaptive(Node):
    args: tuple[Arg, ...]


@attrs.frozen(kw_only=True)
class Prefill(Node):
    mode: Ident
    """`mixed` (prompts chunked beside decodes) or `separate` (vLLM V0)."""
    args: tuple[Arg, ...]


@attrs.frozen(kw_only=True)
class Preempt(Node):
    mode: Ident
    displace: bool
    short_of_block: Ident | None = None
    """Who is preempted when a running request lacks its next block: `below` (default, the
    running requests ranked below it) or `self` (the request itself, BROS §7.4.1's ablation)."""


@attrs.frozen(kw_only=True)
class Overload(Node):
    action: Ident
    cond: Expr
    hold: Expr | None


@attrs.frozen(kw_only=True)
class Dispatch(Node):
    rule: Ident
    """round_robin, least_load, most_free_kv or freeness (engine/cluster/dispatch.py)."""


@attrs.frozen(kw_only=True)
class MemSetting(Node):
    name: Ident
    value: Ident
    """As written, hyphens included (`per-block`)."""


@attrs.frozen(kw_only=True)
class Memory(Node):
    settings: tuple[MemSetting, ...]


Statement = Union[Include, ClassDecl, DefaultClass, PriorityRule, Precedence, Alternate, Rerank,
                  Fair, Pack, BatchMax, BatchAdaptive, Prefill, Preempt, Overload, Memory,
                  Dispatch]


@attrs.frozen(kw_only=True)
class PolicyFile(Node):
    name: Ident | None
    """None for a fragment (statements without `policy NAME { }`, meant to be included)."""
    extends: String | None
    body: tuple[Statement, ...]
    close: Span | None = None
    """The closing brace of a policy (where the REPL appends a new rule)."""

    @property
    def is_fragment(self) -> bool:
        return self.name is None


RuleKey = tuple[str, ...]


def rule_keys(stmt: Statement) -> tuple[RuleKey, ...]:
    """What a statement sets; a later statement with the same key replaces it."""
    match stmt:
        case ClassDecl(name=n):
            return (("class", n.name),)
        case DefaultClass():
            return (("default class",),)
        case PriorityRule(cls=c):
            return (("priority", c.name if c else "*"),)
        case Precedence() | Alternate():
            return (("precedence",),)
        case Rerank():
            return (("rerank",),)
        case Fair():
            return (("fair",),)
        case Pack():
            return (("pack",),)
        case BatchMax() | BatchAdaptive():
            return (("batch",),)
        case Prefill():
            return (("prefill",),)
        case Preempt():
            return (("preempt",),)
        case Dispatch():
            return (("dispatch",),)
        case Overload(action=a):
            return (("overload", a.name),)
        case Memory(settings=ss):
            return tuple(("memory", s.name.name) for s in ss)
        case Include():
            return ()
    raise AssertionError(f"unknown statement {stmt!r}")


def describe_key(key: RuleKey) -> str:
    match key:
        case ("class", name):
            return f"class {name}"
        case ("priority", "*"):
            return "the priority of every class"
        case ("priority", name):
            return f"the priority of class {name}"
        case ("overload", action):
            return f"overload {action}"
        case ("memory", name):
            return f"memory setting {name}"
        case _:
            return key[0]
