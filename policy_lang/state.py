"""The state a compiled policy carries between iterations: rerank priorities, fairness counters,
the adaptive batch size and the overload triggers. Plain Python; no Lark."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Literal

from engine.policy import IterationOutcome, OverloadSignal, SchedulerView

Condition = Callable[[Any], Any]


class Rerank:
    """Periodic priority updates (FastSwitch §4): every N iterations (or T milliseconds) every
    live request gets a new priority value, held until the next rerank; a request that arrives
    in between gets one on arrival.

    The paper precomputes its priority traces, so every system it compares sees the same ones.
    Here too: the value a request gets at its k-th update (k = 0 on arrival) depends only on the
    policy's seed, the request's trace id (`SchedulingParams.trace_id`, which the bench sets to
    the workload's seed and the request's index in it; the engine's request id without one) and
    k, never on what the engine did, so two policies replaying one workload give every request
    the same sequence of priorities.

    `markov`: each request walks a two-state chain, top or not: it stays on top with probability
    `stay` and gets there from below with probability `1 - stay` (half the requests on top in the
    long run). Its value is the number of consecutive updates it has been on top plus a tie-break
    drawn when it got there, so those that have been on top longest, most recently served, come
    first and newcomers queue behind them (FastSwitch §4: "requests that have been frequently or
    recently served are given higher priority"). `random`: a fresh uniform value at every update.
    """

    def __init__(self, *, pattern: Literal["markov", "random"], stay: float, seed: int,
                 every_iterations: int | None, every_ms: float | None) -> None:
        self.pattern = pattern
        self.stay = stay
        self.seed = seed
        self.every_iterations = every_iterations
        self.every_ms = every_ms
        self.values: dict[int, float] = {}
        """request id -> assigned priority (larger is more important); updated in place."""
        self.reranks = 0
        self._walks: dict[int, list] = {}
        """request id -> [trace key, updates seen, consecutive updates on top, tie-break]."""
        self._last_iteration: int | None = None
        self._last_now = 0.0

    def before(self, view: SchedulerView) -> None:
        due = self._due(view)
        if due:
            self._last_iteration, self._last_now = view.iteration, view.now
            self.reranks += 1
        walks, values = self._walks, self.values
        for r in view.requests:
            walk = walks.get(r.id)
            if walk is None:
                key = r.trace_id if r.trace_id is not None else f"engine/{r.id}"
                walk = walks[r.id] = [key, -1, 0, 0.0]
                values[r.id] = self._step(walk)
            elif due:
                values[r.id] = self._step(walk)
        if len(walks) > 2 * len(view.requests) + 64:  # forget finished requests
            live = {r.id for r in view.requests}
            for rid in [rid for rid in walks if rid not in live]:
                del walks[rid]
                values.pop(rid, None)

    def _due(self, view: SchedulerView) -> bool:
        if self._last_iteration is None:
            return True
        if self.every_iterations is not None:
            return view.iteration - self._last_iteration >= self.every_iterations
        assert self.every_ms is not None
        return (view.now - self._last_now) * 1000.0 >= self.every_ms

    def _step(self, walk: list) -> float:
        """The request's next update: its value at update k = walk[1] + 1."""
        key, k = walk[0], walk[1] + 1
        walk[1] = k
        if self.pattern == "random":
            return self._uniform(key, k, "value")
        on_top = walk[2] > 0
        chance = 0.5 if k == 0 else (self.stay if on_top else 1.0 - self.stay)
        if self._uniform(key, k, "top") < chance:
            if not on_top:
                walk[3] = self._uniform(key, k, "tie")
            walk[2] += 1
        else:
            walk[2] = 0
            walk[3] = self._uniform(key, k, "tie")
        return walk[2] + walk[3]

    def _uniform(self, key: str, k: int, what: str) -> float:
        """A uniform [0, 1) value that depends only on the seed, the trace key, k and `what`."""
        digest = hashlib.blake2b(f"{self.seed}/{key}/{k}/{what}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2.0**64


class FairCounters:
    """Virtual token counters per tenant, in the style of VTC (Sheng et al., OSDI 2024): each
    tenant is charged `input` per prompt token computed and `output` per token generated; a
    tenant that comes back after having nothing queued starts at the least-served active
    tenant's count, so idling banks no credit."""

    def __init__(self, *, input_price: float, output_price: float) -> None:
        self.input_price = input_price
        self.output_price = output_price
        self.service: dict[str, float] = {}
        """tenant -> weighted tokens served; updated in place."""
        self._active: set[str] = set()

    def before(self, view: SchedulerView) -> None:
        tenants = {r.tenant for r in view.requests}
        if tenants == self._active:
            return
        service = self.service
        staying = [service.get(t, 0.0) for t in tenants & self._active]
        floor = min(staying) if staying else None
        for t in tenants - self._active:
            mine = service.get(t, 0.0)
            service[t] = mine if floor is None else max(mine, floor)
        self._active = tenants

    def observe(self, outcome: IterationOutcome) -> None:
        service, pin, pout = self.service, self.input_price, self.output_price
        for r, prompt, output in outcome.served:
            service[r.tenant] = service.get(r.tenant, 0.0) + pin * prompt + pout * output


class FixedBatch:
    def __init__(self, size: int) -> None:
        self.size = size

    def limit(self, view: SchedulerView) -> int:
        return self.size

    def note_predicted_violation(self) -> None:
        pass

    def observe(self, outcome: IterationOutcome) -> None:
        pass


class AdaptiveBatch:
    """BROS §4.2, adaptive batch sizing: start at `start`, grow by `grow` after every calm
    iteration, fall back to `start` after a violation: predicted (packing found the batch would
    miss the tightest deadline) and/or observed (a token was late), as `reset_on` says."""

    def __init__(self, *, start: int, grow: int, cap: int | None,
                 reset_on: Literal["violation", "predicted", "observed"]) -> None:
        self.start = start
        self.grow = grow
        self.cap = cap
        self.reset_on = reset_on
        self.size = start
        self.resets = 0
        self._ceiling = cap
        self._predicted = False

    def limit(self, view: SchedulerView) -> int:
        self._ceiling = self.cap or view.max_num_seqs
        return min(self.size, self._ceiling)

    def note_predicted_violation(self) -> None:
        self._predicted = True

    def observe(self, outcome: IterationOutcome) -> None:
        predicted = self._predicted and self.reset_on != "observed"
        observed = outcome.deadline_misses > 0 and self.reset_on != "predicted"
        self._predicted = False
        if predicted or observed:
            self.size = self.start
            self.resets += 1
        else:
            self.size = min(self.size + self.grow, self._ceiling or self.size + self.grow)


class OverloadTriggers:
    """KunServe §4.1 and §4.4: `drop` fires while its condition has held for `drop_hold`
    consecutive iterations (or, with `drop_hold_s`, for that many seconds of the view's clock);
    after a drop, `restore` fires once its condition has held for `restore_hold` iterations (or
    `restore_hold_s` seconds). Evaluated once per iteration; a duration counts from the first
    evaluation at which the condition held, on the clock of whoever evaluates (an engine's, or
    the cluster monitor's: virtual in the simulator, real on torch), so it does not stretch when
    the evaluations do."""

    def __init__(self, *, drop: Condition, drop_hold: int, restore: Condition | None,
                 restore_hold: int, drop_hold_s: float | None = None,
                 restore_hold_s: float | None = None) -> None:
        self._drop, self._drop_hold, self._drop_hold_s = drop, drop_hold, drop_hold_s
        self._restore, self._restore_hold = restore, restore_hold
        self._restore_hold_s = restore_hold_s
        self.dropped = False
        self._drop_run = self._restore_run = 0
        self._drop_since: float | None = None
        self._restore_since: float | None = None
        self._iteration: int | None = None
        self._signal: OverloadSignal | None = None

    def evaluate(self, view: SchedulerView) -> OverloadSignal | None:
        if view.iteration == self._iteration:
            return self._signal
        self._iteration = view.iteration
        now = getattr(view, "now", 0.0)
        held = self._drop(None)
        self._drop_run = self._drop_run + 1 if held else 0
        self._drop_since = (now if self._drop_since is None else self._drop_since) if held else None
        self._signal = None
        if _long_enough(self._drop_run, self._drop_hold, self._drop_since, self._drop_hold_s, now):
            self.dropped, self._signal = True, "drop"
            self._restore_run, self._restore_since = 0, None
        elif self.dropped and self._restore is not None:
            held = self._restore(None)
            self._restore_run = self._restore_run + 1 if held else 0
            self._restore_since = ((now if self._restore_since is None else self._restore_since)
                                   if held else None)
            if _long_enough(self._restore_run, self._restore_hold, self._restore_since,
                            self._restore_hold_s, now):
                self.dropped, self._signal = False, "restore"
                self._restore_run, self._restore_since = 0, None
        return self._signal


def _long_enough(run: int, hold: int, since: float | None, hold_s: float | None,
                 now: float) -> bool:
    """A condition held `run` evaluations running, since `since`: enough for its hold?"""
    if hold_s is None:
        return run >= hold
    return since is not None and now - since >= hold_s - 1e-9  # 40 x 0.05 s sums to 1.9999...
