"""`shunter policy explain`: a checked policy's effective rules in plain words."""

from __future__ import annotations

from policy_lang import ast
from policy_lang.check import (
    class_names,
    default_class,
    read_args,
    read_value,
)
from policy_lang.exprs import constant, fmt
from policy_lang.fields import FIELDS, Type
from policy_lang.loader import RuleSet
from policy_lang.prefill import explain_prefill
from policy_lang.settings import ADAPTIVE, CLASS_SETTINGS, FAIR_SETTINGS, PATTERNS

_PREEMPT = {
    "recompute": "by recompute: a preempted request drops its KV cache and computes it again "
                 "when it resumes",
    "swap": "by swap: a preempted request's KV cache is copied to host memory and back",
    "never": "never (unless every running request is stuck waiting for memory)",
}
_MEMORY = {
    ("swap_granularity", "per-block"): "swap copies one block at a time (vLLM)",
    ("swap_granularity", "groups"): "swap copies whole block groups (FastSwitch §3.1)",
    ("swap_in", "sync"): "swap-in finishes before the iteration that needs it",
    ("swap_in", "async"): "swap-in overlaps with inference (FastSwitch §3.2)",
    ("swap_in", "adaptive"): "swap-in is sync or async, chosen per iteration (FastSwitch §3.2)",
    ("kv_reuse", "on"): "host copies of a conversation's KV are reused across turns "
                        "(FastSwitch §3.3)",
    ("kv_reuse", "off"): "no KV reuse across turns",
    ("turn_copies", "on"): "with KV reuse, an ended turn's KV is copied to the host for the next "
                           "turn (FastSwitch §3.3)",
    ("turn_copies", "off"): "with KV reuse, only preemption copies are reused; an ended turn's KV "
                            "is not copied (the next turn prefills it)",
    ("prefix_cache", "on"): "full device KV blocks are cached by their tokens and reused by any "
                            "later request with the same prefix, least recently used evicted first",
    ("prefix_cache", "off"): "no prefix caching",
    ("bidirectional", "on"): "RT requests fill KV blocks from the left and BE requests from the "
                             "right; RT overwrites BE slots after checkpointing just those to the "
                             "host (BROS §5)",
    ("bidirectional", "off"): "no block is shared between requests",
    ("kv_exchange", "fifo"): "a pipeline group's exchanged KV shares one queue with activations",
    ("kv_exchange", "coordinated"): "a pipeline group's KV moves in chunks, activations first "
                                    "(KunServe §4.2)",
    ("microbatch", "tokens"): "a pipeline group cuts its steps into microbatches by tokens",
    ("microbatch", "lookahead"): "a pipeline group forms cost-balanced microbatches over the "
                                 "lookahead window (KunServe §4.3)",
    ("restore_prefetch", "on"): "a restoring group's dropped weights and full KV blocks come "
                                "back while it keeps serving; the restore's step moves the rest",
    ("restore_prefetch", "off"): "a group restores all at once, at one step (no step runs "
                                 "meanwhile)",
    ("restore_from", "peer"): "a restore takes the dropped layers from the members keeping them",
    ("restore_from", "host"): "a restore takes the dropped layers from each member's host copy",
}


def explain(rules: RuleSet) -> str:
    x = _Explainer(rules)
    sections = [x.header(), x.classes(), x.order(), x.rerank(), x.fair(), x.batch(),
                explain_prefill(rules), x.preempt(), x.overload(), x.memory(), x.dispatch()]
    return "\n\n".join(s for s in sections if s) + "\n"


class _Explainer:
    def __init__(self, rules: RuleSet) -> None:
        self.rules = rules
        self.names = class_names(rules)

    def text(self, node: ast.Node) -> str:
        src = self.rules.sources.get(node.span.file, "")
        return " ".join(src[node.span.start:node.span.end].split())

    def header(self) -> str:
        lines = [f"Policy {self.rules.name} ({self.rules.file})."]
        for line in self.rules.sources[self.rules.file].splitlines():
            if not line.startswith("#"):
                break
            lines.append("  " + line.lstrip("# ").rstrip())
        return "\n".join(lines)

    def classes(self) -> str:
        default = default_class(self.rules)
        out = ["Request classes:"]
        for name in self.names:
            decl = self.rules.get("class", name)
            values = {s.name.name: read_value(s.value, CLASS_SETTINGS[s.name.name])
                      for s in (decl.settings if decl else ())}
            goals = []
            if "ttft" in values:
                goals.append(f"first token within {fmt(values['ttft'])} ms")
            if "tpot" in values:
                goals.append(f"then a token every {fmt(values['tpot'])} ms")
            if "max_running" in values:
                goals.append(f"at most {values['max_running']} running at once")
            if "max_queued" in values:
                goals.append(f"at most {values['max_queued']} queued")
            tag = " (the default for requests that name no class)" if name == default else ""
            out.append(f"  {name}{tag}: {', '.join(goals) or 'no deadlines'}.")
        return "\n".join(out)

    def keys(self, cls: str | None) -> str:
        rule = (self.rules.get("priority", cls) if cls else None) or self.rules.get("priority", "*")
        if rule is None:
            return "by arrival, earliest first"
        parts = []
        for k in rule.keys:
            t = _type_of(k.expr)
            if t == Type.BOOL:
                way = "those where it holds first" if k.descending else "those where it holds last"
            elif t == Type.TIME:
                way = "latest first" if k.descending else "earliest first"
            else:
                way = "largest first" if k.descending else "smallest first"
            parts.append(f"by {self.text(k.expr)}, {way}")
        return ", then ".join(parts)

    def order(self) -> str:
        prec, pack = self.rules.get("precedence"), self.rules.get("pack")
        if pack is not None:
            return self.pack(pack)
        if isinstance(prec, ast.Alternate):
            turns = ", then ".join(c.name for c in prec.classes)
            lines = [f"Order: classes take turns, one class per iteration ({turns}, BROS §2.2 "
                     "round robin); a class with nothing to run passes its turn."]
        elif isinstance(prec, ast.Precedence):
            lines = ["Order: class " + " before class ".join(c.name for c in prec.classes) + "."]
        else:
            cls = self.names[0] if len(self.names) == 1 else None
            return f"Order: all requests {self.keys(cls)}."
        lines += [f"  Within {c}: {self.keys(c)}." for c in self.names]
        return "\n".join(lines)

    def pack(self, pack: ast.Pack) -> str:
        lines = ["Order: each iteration's batch is packed (BROS §4.2):"]
        for i, s in enumerate(pack.steps, 1):
            if isinstance(s, ast.Take):
                lines.append(f"  {i}. take {s.cls.name} requests ({self.keys(s.cls.name)}) while "
                             f"{self.text(s.cond)}; the first that fails ends this step and counts "
                             "as a predicted deadline violation.")
            elif isinstance(s, ast.Fill):
                cond = f" and {self.text(s.cond)}" if s.cond is not None else ""
                lines.append(f"  {i}. fill with {s.cls.name} requests ({self.keys(s.cls.name)}) "
                             f"while the batch has room{cond}.")
            else:
                lines.append(f"  {i}. each {s.cls.name} request left over replaces the least urgent "
                             f"{s.victim.name} request in the batch while, for that request, "
                             f"{self.text(s.cond)}.")
        lines.append("  A request's deadline counts the iterations its token still needs "
                     "(min_slack is slack over them); one that cannot make it comes after those "
                     "that can. A waiting request joins only if its blocks are free or held by "
                     "running requests of a class packed later, which lose them first.")
        lines.append("  Requests not packed get no work this iteration; running ones keep their "
                     "memory unless a packed request needs it.")
        lines.append("  est_iteration is predicted by the engine's cost model (a profile, or one "
                     "fitted in the engine from its own iterations); before the engine has one, "
                     "by the moving average of observed iteration times (BROS Table 1).")
        return "\n".join(lines)

    def rerank(self) -> str:
        rr = self.rules.get("rerank")
        if rr is None:
            return ""
        kind, value = constant(rr.schedule.amount)
        if rr.schedule.kind == "frequency":
            every = f"every {max(1, round(1 / value))} iterations (frequency {fmt(value)})"
        elif kind == Type.ITERATIONS:
            every = f"every {fmt(value)} iterations (frequency {fmt(1 / value)})"
        else:
            every = f"every {fmt(value)} ms"
        args = read_args(rr.pattern.args, PATTERNS[rr.pattern.func.name])
        if rr.pattern.func.name == "markov":
            how = (f"Markov pattern (FastSwitch §4): a request running at the update stays on top "
                   f"with probability {fmt(args['stay'])}, others move up so the top stays the "
                   f"same size")
        else:
            how = "Random pattern (FastSwitch §4): fresh uniform priorities, no memory"
        return (f"Priority updates: {every}, every live request gets a new assigned_priority; "
                f"{how}; seed {args['seed']}. A request arriving in between gets one on arrival.")

    def fair(self) -> str:
        fair = self.rules.get("fair")
        if fair is None:
            return ""
        v = {s.name.name: read_value(s.value, FAIR_SETTINGS[s.name.name]) for s in fair.settings}
        return (f"Fairness (VTC style): tokens served are counted per tenant (tenant_service), "
                f"prompt tokens at {fmt(v.get('input', 1.0))} and output tokens at "
                f"{fmt(v.get('output', 1.0))} each; a tenant coming back after idling starts at "
                "the least-served active tenant's count.")

    def batch(self) -> str:
        b = self.rules.get("batch")
        if isinstance(b, ast.BatchMax):
            return f"Batch size: at most {fmt(constant(b.limit)[1])} requests per iteration."
        if isinstance(b, ast.BatchAdaptive):
            a = read_args(b.args, ADAPTIVE)
            cap = a["max"] if a["max"] is not None else "the engine's max_num_seqs"
            when = {"violation": "a predicted or an observed deadline violation",
                    "predicted": "a predicted deadline violation",
                    "observed": "an observed deadline violation"}[a["reset_on"]]
            return (f"Batch size (BROS §4.2, adaptive): starts at {a['start']}, grows by "
                    f"{a['grow']} after each calm iteration up to {cap}, and goes back to "
                    f"{a['start']} after {when}.")
        return "Batch size: the engine's limit (max_num_seqs)."

    def dispatch(self) -> str:
        """Only when written: a single engine has nothing to dispatch."""
        d = self.rules.get("dispatch")
        if d is None:
            return ""
        how = {"round_robin": "to each live instance in turn",
               "least_load": "to the live instance with the fewest requests in flight, then the "
                             "least queued demand",
               "most_free_kv": "to the live instance with the largest free share of its KV "
                               "pool",
               "freeness": "to the live instance with the most free KV blocks, after its "
                           "queued requests', per request it serves (Llumnix's freeness)"
               }.get(d.rule.name, d.rule.name)
        return f"Dispatch (a cluster): each new request goes {how}."

    def preempt(self) -> str:
        p = self.rules.get("preempt")
        mode = p.mode.name if p else "recompute"
        displace = ("A waiting request may evict running requests ranked below it."
                    if p is not None and p.displace else
                    "A waiting request does not evict running ones; it waits for memory.")
        if p is not None and p.short_of_block and p.short_of_block.name == "self":
            return (f"Preemption: {_PREEMPT[mode]}. A running request that lacks a block is "
                    f"preempted itself (no other running request is evicted for it). {displace}")
        return (f"Preemption: {_PREEMPT[mode]}. Victims: the least deserving running request "
                f"first (the end of the order). {displace}")

    def overload(self) -> str:
        drop, restore = self.rules.get("overload", "drop"), self.rules.get("overload", "restore")
        if drop is None:
            return ""
        lines = [f"Overload (KunServe §4.1): ask to drop parameters when {self.text(drop.cond)}"
                 + (f" has held for {self.text(drop.hold)}" if drop.hold else "") + "."]
        if restore is not None:
            lines.append(f"  Restore them (KunServe §4.4) when {self.text(restore.cond)}"
                         + (f" has held for {self.text(restore.hold)}" if restore.hold else "") + ".")
        lines.append("  On a cluster the coordinator's monitor evaluates them on every instance (a "
                     "group at its head) and acts; an engine alone only counts and logs them "
                     "(engine.inspect()).")
        return "\n".join(lines)

    def memory(self) -> str:
        settings = {m.name.name: m.value.name for m in self.rules.all("memory")}
        if not settings:
            return ""
        return "Memory: " + "; ".join(_MEMORY[(k, v)] for k, v in settings.items()) + "."


def _type_of(e: ast.Expr) -> Type | None:
    if isinstance(e, ast.BinOp) and e.op in ("<", "<=", ">", ">=", "==", "!=", "and", "or"):
        return Type.BOOL
    if isinstance(e, ast.Not):
        return Type.BOOL
    if isinstance(e, ast.Name):
        return FIELDS[e.name].type
    return None
