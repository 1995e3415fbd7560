"""Checked rules to a `CompiledPolicy`: expressions become Python closures (constants folded,
plain fields read by `operator.attrgetter`), priority rules become sort passes, and the
stateful rules become the objects of state.py and packing.py. Runs once, when a policy loads."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any

from engine.policy import ClassSpec, MemorySettings, PolicySettings
from policy_lang import ast
from policy_lang.check import (
    class_names,
    default_class,
    read_args,
    read_value,
)
from policy_lang.explain import explain
from policy_lang.exprs import constant, literal_value
from policy_lang.fields import FIELDS, Scope, Type
from policy_lang.loader import RuleSet
from policy_lang.packing import Env, IterationTimer, PackOrder, Replace, Take
from policy_lang.prefill import read_prefill
from policy_lang.runtime import (
    AlternateOrder,
    ClassSplit,
    CompiledPolicy,
    MergedOrder,
    Passes,
    PrecedenceOrder,
    sorter,
)
from policy_lang.settings import ADAPTIVE, CLASS_SETTINGS, FAIR_SETTINGS, PATTERNS
from policy_lang.state import AdaptiveBatch, FairCounters, FixedBatch, OverloadTriggers, Rerank

Fn = Callable[[Any], Any]

_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul,
    "/": lambda a, b: a / b if b else math.inf,
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
    "==": operator.eq, "!=": operator.ne,
}


class ExprCompiler:
    def __init__(self, env: Env, rerank: Rerank | None, fair: FairCounters | None) -> None:
        self.env, self.rerank, self.fair = env, rerank, fair

    def fn(self, e: ast.Expr) -> Fn:
        is_const, value = self._c(e)
        return (lambda r: value) if is_const else value

    def _c(self, e: ast.Expr) -> tuple[bool, Any]:
        """(True, value) for a constant, else (False, closure over a request)."""
        match e:
            case ast.Number():
                return True, literal_value(e)
            case ast.String(value=v):
                return True, v
            case ast.Name(name=name):
                return False, self.field(name)
            case ast.Neg(operand=o):
                c, v = self._c(o)
                return (True, -v) if c else (False, lambda r: -v(r))
            case ast.Not(operand=o):
                c, v = self._c(o)
                return (True, not v) if c else (False, lambda r: not v(r))
            case ast.Call(func=f, args=args):
                parts = [self.fn(a.value) for a in args]
                pick = {"min": min, "max": max}.get(f.name)
                if pick is None:
                    (x,) = parts
                    return False, lambda r: abs(x(r))
                return False, lambda r: pick(p(r) for p in parts)
            case ast.BinOp(op="and", left=l, right=rt):
                a, b = self.fn(l), self.fn(rt)
                return False, lambda r: a(r) and b(r)
            case ast.BinOp(op="or", left=l, right=rt):
                a, b = self.fn(l), self.fn(rt)
                return False, lambda r: a(r) or b(r)
            case ast.BinOp(op=op, left=l, right=rt):
                return self._binary(_OPS[op], l, rt)
        raise AssertionError(f"unknown expression {e!r}")

    def _binary(self, op: Callable, left: ast.Expr, right: ast.Expr) -> tuple[bool, Any]:
        if _pack_field(left) and _pack_field(right):  # `est_iteration < min_slack`: packing
            # tests it for every request it tries, so one closure, not one per side as well
            a, b, env = attrgetter(left.name), attrgetter(right.name), self.env
            return False, lambda r: op(a(env), b(env))
        lc, a = self._c(left)
        rc, b = self._c(right)
        if lc and rc:
            return True, op(a, b)
        if rc:
            return False, lambda r: op(a(r), b)
        if lc:
            return False, lambda r: op(a, b(r))
        return False, lambda r: op(a(r), b(r))

    def field(self, name: str) -> Fn:
        f, env = FIELDS[name], self.env
        if name == "age":
            return lambda r: (env.view.now - r.arrival) * 1000.0
        if name == "waited":  # views hold no clock: RequestView.waited_s and slack_ms
            return lambda r: (env.view.now - (r.last_scheduled_at or r.arrival)) * 1000.0
        if name == "slack":
            return lambda r: (r.deadline - env.view.now) * 1000.0
        if name == "assigned_priority":
            get = self.rerank.values.get
            return lambda r: get(r.id, 0.0)
        if name == "tenant_service":
            get = self.fair.service.get
            return lambda r: get(r.tenant, 0.0)
        if name in ("waiting", "running"):
            return lambda r: env.count(name)
        if f.scope == Scope.PACK:
            read = attrgetter(name)
            return lambda r: read(env)
        get, scale = attrgetter(f.attr), f.scale
        if f.scope == Scope.ENGINE:
            return lambda r: get(env.view) * scale
        return get if scale == 1.0 else (lambda r: get(r) * scale)

    def passes(self, keys: tuple[ast.SortKey, ...]) -> Passes:
        """Sort passes, least significant first. Adjacent plain fields sorted the same way
        share one `attrgetter` (a tuple key built in C)."""
        runs: list[tuple[list[str] | Fn, bool]] = []
        for k in keys:
            attr = self._plain_attr(k.expr)
            if attr and runs and isinstance(runs[-1][0], list) and runs[-1][1] == k.descending:
                runs[-1][0].append(attr)
            else:
                runs.append(([attr] if attr else self.fn(k.expr), k.descending))
        out = [(attrgetter(*key) if isinstance(key, list) else key, desc) for key, desc in runs]
        return tuple(reversed(out))

    def _plain_attr(self, e: ast.Expr) -> str | None:
        """A request field read straight off the view (a positive scale keeps the order)."""
        if isinstance(e, ast.Name):
            f = FIELDS[e.name]
            if f.scope == Scope.REQUEST and f.attr is not None and f.scale > 0:
                return f.attr
        return None


def _pack_field(e: ast.Expr) -> bool:
    """A field packing sets on its `Env` before each test (`Field.scope` PACK)."""
    return isinstance(e, ast.Name) and FIELDS[e.name].scope == Scope.PACK


DEFAULT_KEYS = (ast.SortKey(span=None, expr=ast.Name(span=None, name="arrival"), descending=False),)


def build(rules: RuleSet, *, source: str, filename: str, base_dir: Path) -> CompiledPolicy:
    env = Env()
    rerank, fair = _rerank(rules), _fair(rules)
    exprs = ExprCompiler(env, rerank, fair)
    classes, default = class_names(rules), default_class(rules)
    split = ClassSplit(classes, default)
    sorts = [sorter(exprs.passes(_keys(rules, c))) for c in classes]
    batch = _batch(rules)
    timer = IterationTimer()
    order: Any
    pack, prec = rules.get("pack"), rules.get("precedence")
    if pack is not None:
        order = PackOrder(split=split, sort=sorts, steps=_steps(pack, classes, exprs), env=env,
                          timer=timer)
    elif isinstance(prec, ast.Alternate):
        order = AlternateOrder(split, sorts, [classes.index(c.name) for c in prec.classes])
    elif isinstance(prec, ast.Precedence):
        order = PrecedenceOrder(split, sorts, [classes.index(c.name) for c in prec.classes])
    else:
        order = MergedOrder(sorter(exprs.passes(_keys(rules, default if len(classes) == 1 else None))))
    overload = _overload(rules, exprs)
    observers = [o.observe for o in (fair, batch) if o is not None]
    if pack is not None:
        observers.append(timer.observe)
    preempt = rules.get("preempt")
    prefill, token_budget, watermark = read_prefill(rules)
    settings = PolicySettings(
        name=rules.name, classes=tuple(_class_spec(rules, c) for c in classes),
        default_class=default, preempt_mode=preempt.mode.name if preempt else "recompute",
        memory=_memory(rules), dispatch=_dispatch(rules), prefill=prefill,
        token_budget=token_budget, prompt_watermark=watermark,
        short_of_block=(preempt.short_of_block.name if preempt and preempt.short_of_block
                        else "below"))
    spans = {m.name.name: m.span for m in rules.all("memory")}
    if preempt is not None:
        spans["preempt"] = preempt.span
    if rules.get("overload", "drop") is not None:
        spans["overload"] = rules.get("overload", "drop").span
    top = rules.top
    spans["policy"] = top.name.span if top.name else top.span
    return CompiledPolicy(
        settings=settings, source=source, filename=filename, base_dir=base_dir,
        explanation=explain(rules), order=order, env=env,
        displace=bool(preempt and preempt.displace), batch=batch,
        before=[h.before for h in (rerank, fair) if h is not None], observers=observers,
        overload=overload, setting_spans=spans, written=set(spans) - {"policy"},
        sources=rules.sources,
        parts={"rerank": rerank, "fair": fair, "batch": batch, "overload": overload,
               "order": order, "timer": timer})


def _keys(rules: RuleSet, cls: str | None) -> tuple[ast.SortKey, ...]:
    rule = (rules.get("priority", cls) if cls else None) or rules.get("priority", "*")
    return rule.keys if rule is not None else DEFAULT_KEYS


def _class_spec(rules: RuleSet, name: str) -> ClassSpec:
    decl = rules.get("class", name)
    values = {s.name.name: read_value(s.value, CLASS_SETTINGS[s.name.name])
              for s in (decl.settings if decl else ())}
    return ClassSpec(name=name, ttft_ms=values.get("ttft"), tpot_ms=values.get("tpot"),
                     max_running=values.get("max_running"), max_queued=values.get("max_queued"))


def _dispatch(rules: RuleSet) -> str:
    d = rules.get("dispatch")
    return d.rule.name if d is not None else "round_robin"


def _memory(rules: RuleSet) -> MemorySettings:
    values = {m.name.name: m.value.name for m in rules.all("memory")}
    default = MemorySettings()
    return MemorySettings(swap_granularity=values.get("swap_granularity", default.swap_granularity),
                          swap_in=values.get("swap_in", default.swap_in),
                          kv_reuse=values.get("kv_reuse", "off") == "on",
                          turn_copies=values.get("turn_copies", "on") == "on",
                          prefix_cache=values.get("prefix_cache", "off") == "on",
                          bidirectional=values.get("bidirectional", "off") == "on",
                          kv_exchange=values.get("kv_exchange", default.kv_exchange),
                          microbatch=values.get("microbatch", default.microbatch),
                          restore_prefetch=values.get("restore_prefetch", "on") == "on",
                          restore_from=values.get("restore_from", default.restore_from))


def _rerank(rules: RuleSet) -> Rerank | None:
    rr = rules.get("rerank")
    if rr is None:
        return None
    args = read_args(rr.pattern.args, PATTERNS[rr.pattern.func.name])
    kind, value = constant(rr.schedule.amount)
    every_iterations = every_ms = None
    if rr.schedule.kind == "frequency":
        every_iterations = max(1, round(1.0 / value))
    elif kind == Type.ITERATIONS:
        every_iterations = int(value)
    else:
        every_ms = value
    return Rerank(pattern=rr.pattern.func.name, stay=float(args.get("stay", 0.8)),
                  seed=int(args["seed"]), every_iterations=every_iterations, every_ms=every_ms)


def _fair(rules: RuleSet) -> FairCounters | None:
    fair = rules.get("fair")
    if fair is None:
        return None
    values = {s.name.name: read_value(s.value, FAIR_SETTINGS[s.name.name]) for s in fair.settings}
    return FairCounters(input_price=values.get("input", 1.0), output_price=values.get("output", 1.0))


def _batch(rules: RuleSet) -> FixedBatch | AdaptiveBatch | None:
    b = rules.get("batch")
    if isinstance(b, ast.BatchMax):
        return FixedBatch(int(constant(b.limit)[1]))
    if isinstance(b, ast.BatchAdaptive):
        a = read_args(b.args, ADAPTIVE)
        return AdaptiveBatch(start=a["start"], grow=a["grow"], cap=a["max"], reset_on=a["reset_on"])
    return None


def _steps(pack: ast.Pack, classes: list[str], exprs: ExprCompiler) -> list[Take | Replace]:
    steps: list[Take | Replace] = []
    for s in pack.steps:
        i = classes.index(s.cls.name)
        if isinstance(s, ast.Replace):
            steps.append(Replace(cls=i, victim=classes.index(s.victim.name), cond=exprs.fn(s.cond)))
        else:
            cond = exprs.fn(s.cond) if s.cond is not None else None
            steps.append(Take(cls=i, cond=cond, violation=isinstance(s, ast.Take)))
    return steps


def _overload(rules: RuleSet, exprs: ExprCompiler) -> OverloadTriggers | None:
    drop, restore = rules.get("overload", "drop"), rules.get("overload", "restore")
    if drop is None:
        return None

    def hold(o: ast.Overload | None) -> int:  # `for N iterations` (1: none)
        c = constant(o.hold) if o is not None and o.hold is not None else None
        return int(c[1]) if c is not None and c[0] == Type.ITERATIONS else 1

    def hold_s(o: ast.Overload | None) -> float | None:  # `for 2s`: seconds (values are ms)
        c = constant(o.hold) if o is not None and o.hold is not None else None
        return c[1] / 1000.0 if c is not None and c[0] == Type.DURATION else None

    return OverloadTriggers(drop=exprs.fn(drop.cond), drop_hold=hold(drop),
                            restore=exprs.fn(restore.cond) if restore else None,
                            restore_hold=hold(restore), drop_hold_s=hold_s(drop),
                            restore_hold_s=hold_s(restore))
