"""What a compiled policy runs on every iteration. No Lark here: the compiler (compile.py) has
already turned every rule into closures, sort passes and state objects.

Sorting uses stable passes, least significant key first, each with a C-level key where it can
(`operator.attrgetter`), and `reverse=True` for descending keys (still stable); so a compiled
order costs about what a hand-written `sorted(..., key=lambda ...)` does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from engine.policy import (
    Decision,
    EngineCapabilities,
    IterationOutcome,
    OverloadSignal,
    PolicySettings,
    RequestView,
    SchedulerView,
)
from policy_lang.diagnostics import Diagnostic, Span, check_error
from policy_lang.packing import Env

Key = Callable[[RequestView], Any]
Passes = tuple[tuple[Key, bool], ...]
"""(key, descending) sort passes, least significant first."""


def sorter(passes: Passes) -> Callable[[Sequence[RequestView]], list[RequestView]]:
    """A function that orders requests by `passes`; one `sorted` call for a single pass."""
    if len(passes) == 1:
        (key, reverse), = passes

        def one(requests: Sequence[RequestView]) -> list[RequestView]:
            return sorted(requests, key=key, reverse=reverse)
        return one

    def many(requests: Sequence[RequestView]) -> list[RequestView]:
        out = list(requests)
        for key, reverse in passes:
            out.sort(key=key, reverse=reverse)
        return out
    return many


class ClassSplit:
    """Requests grouped by class index; an unknown class counts as the default class (a
    request that arrived under another policy)."""

    def __init__(self, names: Sequence[str], default: str) -> None:
        self._index = {n: i for i, n in enumerate(names)}
        self._default = self._index[default]
        self._n = len(names)

    def __call__(self, requests: Sequence[RequestView]) -> list[list[RequestView]]:
        groups: list[list[RequestView]] = [[] for _ in range(self._n)]
        appends = [g.append for g in groups]
        index, default = self._index.get, self._default
        for r in requests:
            appends[index(r.request_class, default)](r)
        return groups


class MergedOrder:
    """Every request by one rule, classes mixed."""

    violated = False

    def __init__(self, sort: Callable[[Sequence[RequestView]], list[RequestView]]) -> None:
        self._sort = sort

    def __call__(self, view: SchedulerView, limit: int | None) -> list[RequestView]:
        return self._sort(view.requests)


class PrecedenceOrder:
    """Classes in a fixed precedence, each ordered by its own rule."""

    violated = False

    def __init__(self, split: ClassSplit, sorts: Sequence[Callable], ranks: Sequence[int]) -> None:
        self._split, self._sorts, self._ranks = split, sorts, ranks

    def __call__(self, view: SchedulerView, limit: int | None) -> list[RequestView]:
        groups = self._split(view.requests)
        out: list[RequestView] = []
        for i in self._ranks:
            if groups[i]:
                out += self._sorts[i](groups[i])
        return out


class AlternateOrder:
    """Classes take turns, one class per iteration (BROS §2.2's round-robin baseline); a class
    with nothing live passes its turn. Each decision is a turn: when the turn's requests could
    not run, the next decision goes to the next class, so nothing waits forever."""

    violated = False

    def __init__(self, split: ClassSplit, sorts: Sequence[Callable], turns: Sequence[int]) -> None:
        self._split, self._sorts, self._turns = split, sorts, turns
        self.turn = 0

    def __call__(self, view: SchedulerView, limit: int | None) -> list[RequestView]:
        groups = self._split(view.requests)
        n = len(self._turns)
        for k in range(n):
            i = self._turns[(self.turn + k) % n]
            if groups[i]:
                self.turn = (self.turn + k + 1) % n
                return self._sorts[i](groups[i])
        return []


class CompiledPolicy:
    """A policy compiled from text; implements `engine.policy.Policy`."""

    def __init__(self, *, settings: PolicySettings, source: str, filename: str, base_dir: Path,
                 explanation: str, order: Any, env: Env, displace: bool, batch: Any,
                 before: Sequence[Callable[[SchedulerView], None]],
                 observers: Sequence[Callable[[IterationOutcome], None]], overload: Any,
                 setting_spans: Mapping[str, Span], written: Collection[str],
                 sources: Mapping[str, str], parts: Mapping[str, Any]) -> None:
        self.settings = settings
        self.source = source
        self.filename = filename
        self.base_dir = base_dir
        self._explanation = explanation
        self._order, self._env, self._displace, self._batch = order, env, displace, batch
        self._before, self._observers, self._overload = tuple(before), tuple(observers), overload
        self._spans, self._written, self._sources = setting_spans, frozenset(written), sources
        self.parts = parts
        """Named runtime state (`rerank`, `fair`, `batch`, `overload`) for tests and the REPL."""

    def decide(self, view: SchedulerView) -> Decision:
        if self.settings.token_budget:  # `prefill ...(budget = N tokens)`: packing's budget too
            view = attrs.evolve(view, max_batched_tokens=self.settings.token_budget)
        self._env.begin(view)
        for hook in self._before:
            hook(view)
        batch = self._batch
        limit = batch.limit(view) if batch is not None else None
        order = self._order(view, limit)
        if self._order.violated and batch is not None:
            batch.note_predicted_violation()
        overload = self._overload.evaluate(view) if self._overload is not None else None
        return Decision(order=order, max_batch=limit, displace=self._displace, overload=overload,
                        batch=getattr(self._order, "batch", None))

    def overload_signal(self, view: Any) -> OverloadSignal | None:
        """The `overload` triggers alone, on `view` (a `SchedulerView`, or the cluster
        coordinator's `engine.cluster.overload.ClusterLoad`: KunServe's global monitor)."""
        if self._overload is None:
            return None
        self._env.begin(view)
        return self._overload.evaluate(view)

    def observe(self, outcome: IterationOutcome) -> None:
        for observe in self._observers:
            observe(outcome)

    def explain(self) -> str:
        """The compiled rules in plain words."""
        return self._explanation

    def check_supported(self, capabilities: EngineCapabilities) -> None:
        """Raise PolicyCheckError, pointing at each setting the engine cannot honour."""
        problems = capabilities.unsupported(self.settings, written=self._written)
        if problems:
            diags = [Diagnostic(span=self._spans.get(name, self._spans["policy"]), message=why)
                     for name, why in problems]
            raise check_error(diags, self._sources, by_position=False)  # the mode first

    def __repr__(self) -> str:
        return f"<CompiledPolicy {self.settings.name} from {self.filename}>"
