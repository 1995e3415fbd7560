"""Expression typing: units and types of expressions, constant folding, with error messages
that name the units involved and suggest the fix (`write 400ms`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs

from policy_lang import ast
from policy_lang.diagnostics import did_you_mean, one_of
from policy_lang.fields import (
    FIELDS,
    FUNCTIONS,
    SCOPE_WORDS,
    UNIT_HINT,
    UNIT_SCALE,
    UNIT_TYPES,
    Scope,
    Type,
    fields_in,
)

ARITH = ("+", "-", "*", "/")
COMPARE = ("<", "<=", ">", ">=", "==", "!=")
_VERB = {"+": ("add", "to"), "-": ("subtract", "from"), "*": ("multiply", "by"),
         "/": ("divide", "by")}


def fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def unit_example(t: Type, value: float = 1.0) -> str:
    return {Type.DURATION: f"{fmt(value)}ms", Type.TOKENS: f"{fmt(value)} tokens",
            Type.BLOCKS: f"{fmt(value)} blocks", Type.FRACTION: f"{fmt(value)}%",
            Type.ITERATIONS: f"{fmt(value)} iterations"}.get(t, fmt(value))


def literal_value(n: ast.Number) -> float:
    return n.value * UNIT_SCALE.get(n.unit, 1.0)


def arith_type(op: str, lt: Type, rt: Type) -> Type | None:
    """The type of `lt op rt`, or None when the units do not combine."""
    if not (lt.numeric and rt.numeric):
        return None
    scalar = (Type.NUMBER, Type.FRACTION)
    if op in ("+", "-"):
        return lt if lt == rt else None
    if op == "*":
        if lt in scalar:
            return rt
        return lt if rt in scalar else None
    if rt in scalar:
        return lt
    return Type.NUMBER if lt == rt else None


def constant(e: ast.Expr) -> tuple[Type, float] | None:
    """(type, value) of an expression made of literals only; None otherwise."""
    match e:
        case ast.Number():
            return UNIT_TYPES[e.unit], literal_value(e)
        case ast.Neg(operand=o):
            c = constant(o)
            return None if c is None else (c[0], -c[1])
        case ast.BinOp(op=op, left=l, right=r) if op in ARITH:
            lc, rc = constant(l), constant(r)
            if lc is None or rc is None:
                return None
            t = arith_type(op, lc[0], rc[0])
            if t is None or (op == "/" and rc[1] == 0):
                return None
            value = {"+": lc[1] + rc[1], "-": lc[1] - rc[1], "*": lc[1] * rc[1]}.get(op)
            return t, value if value is not None else lc[1] / rc[1]
    return None


def names_in(e: ast.Expr) -> Iterator[ast.Name]:
    match e:
        case ast.Name():
            yield e
        case ast.BinOp(left=l, right=r):
            yield from names_in(l)
            yield from names_in(r)
        case ast.Not(operand=o) | ast.Neg(operand=o):
            yield from names_in(o)
        case ast.Call(args=args):
            for a in args:
                yield from names_in(a.value)


@attrs.frozen(kw_only=True)
class Where:
    """Where an expression appears: which fields it may read, and how to name the place."""

    scope: Scope
    what: str
    """'a priority key', 'a pack condition', ..."""


class ExprChecker:
    """Infers types; reports each problem once through `error(node, message)`."""

    def __init__(self, error: Callable[[ast.Node, str], None], classes: list[str],
                 available: Callable[[ast.Name], str | None]) -> None:
        self.error = error
        self.classes = classes
        self.available = available
        """Says why a field cannot be read in this policy (no rerank, no fair block), or None."""

    def condition(self, e: ast.Expr, where: Where) -> None:
        t = self.infer(e, where)
        if t is not None and t != Type.BOOL:
            self.error(e, f"{where.what} must be a condition (a comparison), got {t.value}")

    def infer(self, e: ast.Expr, where: Where) -> Type | None:
        match e:
            case ast.Number():
                return UNIT_TYPES[e.unit]
            case ast.String():
                return Type.STRING
            case ast.Name():
                return self.name(e, where)
            case ast.Neg(operand=o):
                t = self.infer(o, where)
                if t is not None and not t.numeric:
                    self.error(e, f"cannot negate {t.value}")
                    return None
                return t
            case ast.Not(operand=o):
                t = self.infer(o, where)
                if t is not None and t != Type.BOOL:
                    self.error(o, f"'not' needs a condition, got {t.value}")
                    return None
                return Type.BOOL
            case ast.Call():
                return self.call(e, where)
            case ast.BinOp(op=op) if op in ("and", "or"):
                for side in (e.left, e.right):
                    t = self.infer(side, where)
                    if t is not None and t != Type.BOOL:
                        self.error(side, f"'{op}' needs conditions on both sides, got {t.value}")
                return Type.BOOL
            case ast.BinOp(op=op) if op in COMPARE:
                return self.compare(e, where)
            case ast.BinOp():
                return self.arith(e, where)
        raise AssertionError(f"unknown expression {e!r}")

    def name(self, e: ast.Name, where: Where) -> Type | None:
        f = FIELDS.get(e.name)
        if f is None:
            hint = did_you_mean(e.name, fields_in(where.scope))
            self.error(e, f"unknown field '{e.name}'{hint}")
            return None
        if not f.scope & where.scope:
            allowed = " and ".join(SCOPE_WORDS[s] for s in (Scope.REQUEST, Scope.ENGINE, Scope.PACK)
                                   if s & where.scope)
            self.error(e, f"'{e.name}' is one of the {SCOPE_WORDS[f.scope]}; {where.what} can "
                          f"read {allowed} only")
            return None
        why = self.available(e)
        if why:
            self.error(e, why)
            return None
        return f.type

    def call(self, e: ast.Call, where: Where) -> Type | None:
        name = e.func.name
        if name not in FUNCTIONS:
            self.error(e.func, f"unknown function '{name}'{did_you_mean(name, FUNCTIONS)}")
            return None
        if any(a.name is not None for a in e.args):
            self.error(e, f"{name}() takes no named arguments")
            return None
        want = "1" if name == "abs" else "2 or more"
        if (name == "abs") != (len(e.args) == 1) or not e.args:
            self.error(e, f"{name}() takes {want} arguments, got {len(e.args)}")
            return None
        types = [self.infer(a.value, where) for a in e.args]
        if None in types:
            return None
        if any(not t.numeric for t in types) or len(set(types)) > 1:
            shown = ", ".join(t.value for t in types)
            self.error(e, f"{name}() needs numbers of one unit, got {shown}")
            return None
        return types[0]

    def compare(self, e: ast.BinOp, where: Where) -> Type | None:
        lt, rt = self.infer(e.left, where), self.infer(e.right, where)
        if lt is None or rt is None:
            return None
        if lt == rt:
            if lt == Type.STRING:
                if e.op not in ("==", "!="):
                    self.error(e, f"text can only be compared with == or !=, not {e.op}")
                    return None
                self.string_values(e)
            return Type.BOOL
        self.error(e, self.mismatch("compare", e, lt, rt))
        return None

    def arith(self, e: ast.BinOp, where: Where) -> Type | None:
        lt, rt = self.infer(e.left, where), self.infer(e.right, where)
        if lt is None or rt is None:
            return None
        t = arith_type(e.op, lt, rt)
        if t is None:
            verb, prep = _VERB[e.op]
            if e.op == "+":
                self.error(e, self.mismatch("add", e, rt, lt, prep="to"))
            elif e.op == "-":
                self.error(e, self.mismatch("subtract", e, rt, lt, prep="from"))
            else:
                self.error(e, self.mismatch(verb, e, lt, rt, prep=prep))
        return t

    def mismatch(self, verb: str, e: ast.BinOp, a: Type, b: Type, prep: str = "with") -> str:
        text = f"cannot {verb} {a.value} {prep} {b.value}"
        target = b if a == Type.NUMBER else a
        for side in (e.left, e.right):
            if isinstance(side, ast.Number) and side.unit is None and target in UNIT_HINT:
                value = side.value
                if target == Type.FRACTION and value <= 1:
                    value *= 100  # 0.95 meant 95%
                return f"{text}; write {unit_example(target, value)}"
        if Type.TIME in (a, b):
            return f"{text}; arrival is a point in time: use age for the time since arrival"
        return text

    def string_values(self, e: ast.BinOp) -> None:
        """`class == "rt"`: the text must be a declared class (a known state, ...)."""
        for field, lit in ((e.left, e.right), (e.right, e.left)):
            if isinstance(field, ast.Name) and isinstance(lit, ast.String):
                known = self.classes if field.name == "class" else list(FIELDS[field.name].values)
                if known and lit.value not in known:
                    self.error(lit, f"unknown {field.name} \"{lit.value}\"{did_you_mean(lit.value, known)}"
                                    f" (known: {one_of(known)})")
