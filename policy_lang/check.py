"""The checker: everything a policy can get wrong after it parses, reported with spans.

Unknown names get a "did you mean"; settings and arguments are checked for their unit, range
and kind; the rules are checked against each other (a rerank nobody orders by, classes with
their own priority rules but no precedence, a class that pack never takes).
"""

from __future__ import annotations

from engine.cluster.dispatch import DISPATCH_RULES
from policy_lang import ast
from policy_lang.diagnostics import Diagnostic, did_you_mean, one_of
from policy_lang.exprs import ExprChecker, Where, constant, fmt, names_in, unit_example
from policy_lang.fields import UNIT_HINT, Scope, Type
from policy_lang.loader import RuleSet
from policy_lang.settings import (
    ADAPTIVE,
    CLASS_SETTINGS,
    FAIR_SETTINGS,
    MEMORY,
    OVERLOAD_ACTIONS,
    PATTERNS,
    PREEMPT_MODES,
    Param,
)


_PRIORITY = Where(scope=Scope.REQUEST, what="a priority key")
_PACK = Where(scope=Scope.REQUEST | Scope.ENGINE | Scope.PACK, what="a pack condition")
_OVERLOAD = Where(scope=Scope.ENGINE, what="an overload condition")


def class_names(rules: RuleSet) -> list[str]:
    return [k[1] for k in rules.rules if k[0] == "class"] or ["default"]


def default_class(rules: RuleSet) -> str:
    d = rules.get("default class")
    names = class_names(rules)
    if isinstance(d, ast.DefaultClass):
        return d.name.name
    return "default" if "default" in names else names[0]


def read_value(e: ast.Expr, p: Param) -> object:
    """The value of a checked setting or argument."""
    if p.kind == "symbol":
        return e.name  # type: ignore[union-attr]
    c = constant(e)
    assert c is not None
    return int(c[1]) if p.kind in ("whole", "tokens") else c[1]


def read_args(args: tuple[ast.Arg, ...], spec: dict[str, Param]) -> dict[str, object]:
    """Argument values of a checked call, defaults filled in."""
    values = {name: p.default for name, p in spec.items()}
    names = list(spec)
    for i, a in enumerate(args):
        name = a.name.name if a.name else names[i]
        values[name] = read_value(a.value, spec[name])
    return values


class Checker:
    def __init__(self, rules: RuleSet) -> None:
        self.rules = rules
        self.diags: list[Diagnostic] = []
        self.classes = class_names(rules)
        self.exprs = ExprChecker(self.error, self.classes, self.unavailable)

    def error(self, node: ast.Node, message: str) -> None:
        self.diags.append(Diagnostic(span=node.span, message=message))

    def run(self) -> list[Diagnostic]:
        self.check_classes()
        self.check_priorities()
        self.check_order()
        self.check_rerank()
        self.check_fair()
        self.check_pack()
        self.check_batch()
        self.check_preempt()
        self.check_dispatch()
        self.check_overload()
        self.check_memory()
        return self.diags

    # ----------------------------------------------------------------------------- values

    def value(self, e: ast.Expr, p: Param, what: str) -> None:
        if p.kind == "symbol":
            if not isinstance(e, ast.Name) or e.name not in p.symbols:
                got = e.name if isinstance(e, ast.Name) else "an expression"
                self.error(e, f"{what} must be one of {one_of(p.symbols)}, got {got}"
                              f"{did_you_mean(got, p.symbols)}")
            return
        c = constant(e)
        if c is None:
            self.error(e, f"{what} must be a fixed value, not an expression over fields")
            return
        t, v = c
        want = {"duration": (Type.DURATION,), "share": (Type.NUMBER, Type.FRACTION),
                "tokens": (Type.TOKENS,)}.get(p.kind, (Type.NUMBER,))
        if t not in want:
            self.error(e, self.unit_message(what, want[0], t, e))
        elif p.kind == "share" and not 0.0 <= v <= 1.0:
            self.error(e, f"{what} must be between 0 and 1 (or 0% and 100%), got {fmt(v)}")
        elif p.kind in ("whole", "tokens") and (not float(v).is_integer() or v < p.minimum):
            self.error(e, f"{what} must be a whole number >= {fmt(p.minimum)}, got {fmt(v)}")
        elif (p.kind in ("duration", "number") and v < 0) or (p.kind == "duration" and v == 0):
            self.error(e, f"{what} must be {'> 0' if p.kind == 'duration' else '>= 0'}, got "
                          f"{unit_example(t, v)}")

    def unit_message(self, what: str, want: Type, got: Type, e: ast.Expr) -> str:
        hint = f" ({UNIT_HINT[want]})" if want in UNIT_HINT else ""
        text = f"{what} needs {want.value}{hint}, got {got.value}"
        if got == Type.NUMBER and isinstance(e, ast.Number) and want in UNIT_HINT:
            text += f"; write {unit_example(want, e.value)}"
        return text

    def settings(self, settings: tuple[ast.Setting, ...], spec: dict[str, Param], owner: str) -> None:
        seen: set[str] = set()
        for s in settings:
            name = s.name.name
            if name not in spec:
                self.error(s.name, f"unknown setting '{name}' in {owner}{did_you_mean(name, spec)}"
                                   f" (settings: {one_of(spec)})")
            elif name in seen:
                self.error(s.name, f"{name} is set twice in {owner}")
            else:
                self.value(s.value, spec[name], name)
            seen.add(name)

    def args(self, call: ast.Node, args: tuple[ast.Arg, ...], spec: dict[str, Param], owner: str) -> None:
        names, seen, named = list(spec), set(), False
        for i, a in enumerate(args):
            if a.name is None:
                if named or i >= len(names):
                    self.error(a, f"{owner} takes arguments {', '.join(names)}; name this one")
                    continue
                name = names[i]
            else:
                named = True
                name = a.name.name
                if name not in spec:
                    self.error(a.name, f"unknown argument '{name}' of {owner}"
                                       f"{did_you_mean(name, names)} (arguments: {', '.join(names)})")
                    continue
            if name in seen:
                self.error(a, f"{name} is given twice")
                continue
            seen.add(name)
            self.value(a.value, spec[name], name)

    def known_class(self, ident: ast.Ident) -> bool:
        if ident.name in self.classes:
            return True
        self.error(ident, f"unknown class '{ident.name}'{did_you_mean(ident.name, self.classes)}"
                          f" (classes: {', '.join(self.classes)})")
        return False

    def unavailable(self, name: ast.Name) -> str | None:
        if name.name == "assigned_priority" and self.rules.get("rerank") is None:
            return ("assigned_priority is set by a rerank; add one, e.g. "
                    "`every 25 iterations: rerank markov(stay = 0.8, seed = 7)`")
        if name.name == "tenant_service" and self.rules.get("fair") is None:
            return "tenant_service is counted by a fair block; add `fair tenant { input 1; output 2 }`"
        return None

    # ------------------------------------------------------------------------- statements

    def check_classes(self) -> None:
        for decl in self.rules.all("class"):
            self.settings(decl.settings, CLASS_SETTINGS, f"class {decl.name.name}")
        d = self.rules.get("default class")
        if isinstance(d, ast.DefaultClass):
            self.known_class(d.name)
        elif len(self.classes) > 1 and "default" not in self.classes:
            first = self.rules.get("class", self.classes[0])
            self.error(first, "several classes and none is the default: say which class requests "
                              f"without one join, e.g. `default class {self.classes[-1]}`")

    def check_priorities(self) -> None:
        for rule in self.rules.all("priority"):
            if rule.cls is not None:
                self.known_class(rule.cls)
            for key in rule.keys:
                t = self.exprs.infer(key.expr, _PRIORITY)
                if t is not None and not t.orderable:
                    self.error(key.expr, f"cannot order by {t.value}")

    def check_order(self) -> None:
        order = self.rules.get("precedence")
        if order is not None:
            seen: set[str] = set()
            all_known = True
            for ident in order.classes:
                if ident.name in seen:
                    self.error(ident, f"class {ident.name} is listed twice")
                elif self.known_class(ident):
                    seen.add(ident.name)
                else:
                    all_known = False
            missing = [c for c in self.classes if c not in seen]
            if missing and all_known:
                self.error(order, f"{type(order).__name__.lower()} leaves out class "
                                  f"{', '.join(missing)}: its requests would never be ordered")
            if self.rules.get("pack") is not None:
                self.error(order, "pack decides the order of classes itself; remove this")
        per_class = [r for r in self.rules.all("priority") if r.cls is not None]
        if per_class and len(self.classes) > 1 and order is None and self.rules.get("pack") is None:
            self.error(per_class[0], "classes have their own priority rules, so say how classes "
                                     "compare: add e.g. `precedence "
                                     f"{' > '.join(self.classes)}` or a pack block")

    def check_rerank(self) -> None:
        rr = self.rules.get("rerank")
        if rr is None:
            return
        name = rr.pattern.func.name
        if name not in PATTERNS:
            self.error(rr.pattern.func, f"unknown rerank pattern '{name}'"
                                        f"{did_you_mean(name, PATTERNS)} (patterns: markov, random)")
        else:
            self.args(rr.pattern, rr.pattern.args, PATTERNS[name], f"{name}()")
        if rr.schedule is None:
            self.error(rr, "this rerank has no schedule: write e.g. "
                           "`every 25 iterations: rerank ...` or `frequency 0.04: rerank ...`")
        else:
            self.schedule(rr.schedule)
        used = any(n.name == "assigned_priority" for r in self.rules.all("priority")
                   for k in r.keys for n in names_in(k.expr))
        if not used:
            self.error(rr, "the rerank has no effect: no priority rule orders by assigned_priority")

    def schedule(self, s: ast.Schedule) -> None:
        c = constant(s.amount)
        if s.kind == "frequency":
            if c is None or c[0] != Type.NUMBER or not 0 < c[1] <= 1:
                self.error(s.amount, "frequency is priority updates per iteration, a number in "
                                     "(0, 1]: 0.04 reranks every 25 iterations")
            return
        if c is None or c[0] not in (Type.ITERATIONS, Type.DURATION):
            got = "an expression" if c is None else c[0].value
            self.error(s.amount, f"every needs iterations or a duration (`every 25 iterations`, "
                                 f"`every 2s`), got {got}")
        elif c[1] <= 0 or c[0] == Type.ITERATIONS and not float(c[1]).is_integer():
            self.error(s.amount, f"every needs a positive whole number of iterations or a "
                                 f"positive duration, got {unit_example(c[0], c[1])}")

    def check_fair(self) -> None:
        fair = self.rules.get("fair")
        if fair is None:
            return
        if fair.subject.name != "tenant":
            self.error(fair.subject, f"fairness is counted per tenant; write `fair tenant {{ ... }}`"
                                     f"{did_you_mean(fair.subject.name, ['tenant'])}")
        self.settings(fair.settings, FAIR_SETTINGS, "fair")

    def check_pack(self) -> None:
        pack = self.rules.get("pack")
        if pack is None:
            return
        taken: set[str] = set()
        for step in pack.steps:
            if not self.known_class(step.cls):
                continue
            if isinstance(step, ast.Replace):
                for ident in (step.cls, step.victim):
                    if ident.name not in taken and self.known_class(ident):
                        self.error(ident, f"class {ident.name} must be taken (or filled) before it "
                                          "can replace or be replaced")
                if step.cls.name == step.victim.name:
                    self.error(step, "a class cannot replace itself")
                self.exprs.condition(step.cond, _PACK)
                continue
            if step.cls.name in taken:
                self.error(step.cls, f"class {step.cls.name} is taken twice")
            taken.add(step.cls.name)
            if step.cond is not None:
                self.exprs.condition(step.cond, _PACK)
        for c in self.classes:
            if c not in taken:
                self.error(pack, f"pack never takes class {c}: its requests would never run")

    def check_batch(self) -> None:
        b = self.rules.get("batch")
        if isinstance(b, ast.BatchMax):
            self.value(b.limit, Param(kind="whole", minimum=1), "batch max")
        elif isinstance(b, ast.BatchAdaptive):
            self.args(b, b.args, ADAPTIVE, "adaptive()")

    def check_preempt(self) -> None:
        if (p := self.rules.get("preempt")) is None:
            return
        if p.mode.name not in PREEMPT_MODES:
            self.error(p.mode, f"unknown preemption mode '{p.mode.name}'"
                               f"{did_you_mean(p.mode.name, PREEMPT_MODES)} (modes: swap, recompute, never)")
        elif p.mode.name == "never" and p.displace:
            self.error(p, "preempt never cannot displace running requests")
        if (s := p.short_of_block) and s.name not in ("below", "self"):
            self.error(s, f"unknown short_of_block '{s.name}'{did_you_mean(s.name, ('below', 'self'))}"
                          " (who is preempted when a running request lacks a block: below, self)")
        elif s and s.name == "self" and p.mode.name == "never":
            self.error(s, "preempt never cannot preempt a request short of a block itself")

    def check_dispatch(self) -> None:
        d = self.rules.get("dispatch")
        if d is not None and d.rule.name not in DISPATCH_RULES:
            self.error(d.rule, f"unknown dispatch rule '{d.rule.name}'"
                               f"{did_you_mean(d.rule.name, DISPATCH_RULES)} "
                               f"(rules: {', '.join(DISPATCH_RULES)})")

    def check_overload(self) -> None:
        for o in self.rules.all("overload"):
            if o.action.name not in OVERLOAD_ACTIONS:
                self.error(o.action, f"unknown overload action '{o.action.name}'"
                                     f"{did_you_mean(o.action.name, OVERLOAD_ACTIONS)} (actions: drop, restore)")
                continue
            self.exprs.condition(o.cond, _OVERLOAD)
            if o.hold is not None:
                self.overload_hold(o.hold)
            if o.action.name == "restore" and self.rules.get("overload", "drop") is None:
                self.error(o, "a restore needs a drop trigger: add `overload drop when ...`")

    def overload_hold(self, hold: ast.Expr) -> None:
        """`for N iterations` (evaluations) or `for 2s` (the evaluator's clock)."""
        c = constant(hold)
        if c is not None and c[0] == Type.ITERATIONS and c[1] >= 1 and float(c[1]).is_integer():
            return
        if c is not None and c[0] == Type.DURATION and c[1] > 0:
            return
        got = "an expression" if c is None else ("a plain number" if c[0] == Type.NUMBER
                                                 else unit_example(c[0], c[1]))
        self.error(hold, "`for` needs a whole number of iterations or a positive duration, "
                         f"e.g. `for 2 iterations` or `for 2s` (ms or s), got {got}")

    def check_memory(self) -> None:
        for m in self.rules.all("memory"):
            name, value = m.name.name, m.value.name
            if name not in MEMORY:
                self.error(m.name, f"unknown memory setting '{name}'{did_you_mean(name, MEMORY)}"
                                   f" (settings: {one_of(MEMORY)})")
            elif value not in MEMORY[name]:
                self.error(m.value, f"{name} must be one of {', '.join(MEMORY[name])}, got "
                                    f"'{value}'{did_you_mean(value, MEMORY[name])}")
        self.check_prefix_cache()
        self.check_bidirectional()

    def check_bidirectional(self) -> None:
        """BROS's bidirectional table places KV slot by slot, one block per table entry, and
        copies slots (a shared block holds two requests' KV, one from each end): block groups
        would have no effect there, a shared block is no one prefix's, and kv_reuse would have
        nothing to keep (its host space holds checkpoints and swapped requests): all refused."""
        values = {m.name.name: m for m in self.rules.all("memory")}
        if (bidi := values.get("bidirectional")) is None or bidi.value.name != "on":
            return
        for name, on, why in (
                ("swap_granularity", "groups", "bidirectional blocks are placed and copied slot "
                 "by slot, one block per table entry, so block groups would have no effect"),
                ("prefix_cache", "on", "a bidirectional block holds two requests' KV, one from "
                 "each end, so it is no one prefix's block to share"),
                ("kv_reuse", "on", "the bidirectional table's host space holds checkpoints and "
                 "swapped requests only, so no KV copy would be kept across turns")):
            if (m := values.get(name)) is not None and m.value.name == on:
                self.error(m.value, f"{name} {on} needs bidirectional off: {why}")

    def check_prefix_cache(self) -> None:
        """Prefix caching shares a full block between requests and keeps it after they end;
        block groups (FastSwitch §3.1) give each request contiguous runs it owns alone, so a
        swap is one copy per run. A cached block in a run would stay behind when the run is
        freed or swapped, cutting free runs into holes and groups into pieces: not combined."""
        values = {m.name.name: m.value.name for m in self.rules.all("memory")}
        if values.get("prefix_cache") != "on":
            return
        cache = next(m for m in self.rules.all("memory") if m.name.name == "prefix_cache")
        if values.get("swap_granularity") == "groups":
            self.error(cache.value, "prefix_cache on needs swap_granularity per-block: block "
                                    "groups give each request contiguous runs of its own, and "
                                    "shared cached blocks would break them up")


def check(rules: RuleSet) -> list[Diagnostic]:
    return Checker(rules).run()
