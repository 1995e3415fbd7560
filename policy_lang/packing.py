"""Priority-based packing (BROS §4.2, Alg. 1): build this iteration's batch class by class.

- `rt while COND`: take RT requests in their priority order (ascending slack) while COND holds
  for the batch with the next one in it; the first that fails stops the step and counts as a
  predicted violation (Alg. 1 lines 11-12, which resets an adaptive batch size);
- `be fill [while COND]`: take BE requests while the batch has room (and COND holds);
- `be replaces rt when COND`: each BE request left over replaces the least urgent RT request
  in the batch, as long as COND holds for that RT request.

The batch is what the order contains: requests left out get no work this iteration and are the
first victims when memory is needed. The iteration time is predicted by the engine's cost model
(BROS §4.1); without one, by the moving average of observed iteration times (BROS Table 1).

`min_slack` is the tightest slack among the batch's requests that can still make their deadline:
a request already too late (its slack below the predicted iteration time) does not count, or it
would block every other RT request and, its slack never recovering, starve itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from engine.cost_model import BatchShape, CostModel
from engine.policy import RequestView, SchedulerView

Condition = Callable[[RequestView], Any]


class Env:
    """What pack conditions and engine statistics read; set before each evaluation."""

    __slots__ = ("view", "est_iteration", "min_slack", "batch_size", "_counts")

    def __init__(self) -> None:
        self.view: SchedulerView | None = None
        self.est_iteration = 0.0
        self.min_slack = math.inf
        self.batch_size = 0
        self._counts: dict[str, int] | None = None

    def begin(self, view: SchedulerView) -> None:
        self.view = view
        self._counts = None

    def count(self, state: str) -> int:
        if self._counts is None:
            counts: dict[str, int] = {}
            for r in self.view.requests:
                counts[r.state] = counts.get(r.state, 0) + 1
            self._counts = counts
        return self._counts.get(state, 0)


class IterationTimer:
    """The moving-average iteration latency (BROS Table 1), for engines without a cost model."""

    def __init__(self) -> None:
        self.average_ms = 0.0

    def observe(self, outcome: Any) -> None:
        ms = outcome.duration_ms
        self.average_ms = ms if self.average_ms == 0.0 else 0.8 * self.average_ms + 0.2 * ms


@attrs.frozen(kw_only=True)
class Take:
    cls: int
    cond: Condition | None
    violation: bool
    """A failed condition is a predicted violation (`rt while`), not just a stop (`fill`)."""


@attrs.frozen(kw_only=True)
class Replace:
    cls: int
    victim: int
    cond: Condition


class _Batch:
    def __init__(self, view: SchedulerView, cost: CostModel | None, average_ms: float,
                 limit: int) -> None:
        self.cost, self.average_ms, self.limit = cost, average_ms, limit
        self.tokens_left = view.max_batched_tokens
        self.selected: list[RequestView] = []
        self.classes: list[int] = []
        self.chunks: list[tuple[int, int]] = []
        self.slacks: list[float] = []
        """Slack each request counts with toward min_slack (inf when it is already late)."""
        self.shape = BatchShape()
        self.min_slack = math.inf

    def full(self) -> bool:
        return len(self.selected) >= self.limit or self.tokens_left <= 0

    def chunk(self, r: RequestView, extra_tokens: int = 0) -> tuple[int, int]:
        return r.computed_tokens, max(1, min(r.remaining_tokens, self.tokens_left + extra_tokens))

    def predict(self, shape: BatchShape) -> float:
        return self.cost.predict_ms(shape) if self.cost is not None else self.average_ms

    def add(self, r: RequestView, cls: int, chunk: tuple[int, int], shape: BatchShape,
            slack: float) -> None:
        self.selected.append(r)
        self.classes.append(cls)
        self.chunks.append(chunk)
        self.slacks.append(slack)
        self.shape = shape
        self.tokens_left -= chunk[1]
        self.min_slack = min(self.min_slack, slack)

    def remove(self, i: int) -> None:
        self.tokens_left += self.chunks[i][1]
        del self.selected[i], self.classes[i], self.chunks[i], self.slacks[i]
        self.shape = BatchShape.of(self.chunks) if self.cost is not None else self.shape
        self.min_slack = min(self.slacks, default=math.inf)


class PackOrder:
    """The order is the packed batch; `violated` says whether packing predicted a miss."""

    def __init__(self, *, split: Callable[[Sequence[RequestView]], list[list[RequestView]]],
                 sort: list[Callable[[list[RequestView]], list[RequestView]]],
                 steps: Sequence[Take | Replace], env: Env, timer: IterationTimer) -> None:
        self._split, self._sort, self._steps = split, sort, steps
        self._env, self._timer = env, timer
        self.violated = False

    def __call__(self, view: SchedulerView, limit: int | None) -> list[RequestView]:
        self.violated = False
        groups = self._split(view.requests)
        left: dict[int, list[RequestView]] = {}
        batch = _Batch(view, view.cost, self._timer.average_ms, limit or view.max_num_seqs)
        for step in self._steps:
            if isinstance(step, Take):
                group = self._sort[step.cls](groups[step.cls])
                left[step.cls] = group[self._take(batch, step, group):]
            else:
                done = self._replace(batch, step, left.get(step.cls, []))
                left[step.cls] = left.get(step.cls, [])[done:]
        return batch.selected

    def _take(self, batch: _Batch, step: Take, group: list[RequestView]) -> int:
        env = self._env
        for i, r in enumerate(group):
            if batch.full():
                return i
            chunk = batch.chunk(r)
            shape = batch.shape.plus(*chunk) if batch.cost is not None else batch.shape
            est = batch.predict(shape)
            slack = r.slack_ms if r.slack_ms >= est else math.inf
            if step.cond is not None:
                env.est_iteration = est
                env.min_slack = min(batch.min_slack, slack)
                env.batch_size = len(batch.selected) + 1
                if not step.cond(r):
                    self.violated = self.violated or step.violation
                    return i
            batch.add(r, step.cls, chunk, shape, slack)
        return len(group)

    def _replace(self, batch: _Batch, step: Replace, candidates: list[RequestView]) -> int:
        env = self._env
        for done, cand in enumerate(candidates):
            i = _last_index(batch.classes, step.victim)
            if i is None:
                return done
            victim = batch.selected[i]
            chunk = batch.chunk(cand, extra_tokens=batch.chunks[i][1])
            rest = batch.chunks[:i] + batch.chunks[i + 1:]
            shape = BatchShape.of(rest + [chunk]) if batch.cost is not None else batch.shape
            est = batch.predict(shape)
            slack = cand.slack_ms if cand.slack_ms >= est else math.inf
            env.est_iteration = est
            env.min_slack = min(min(batch.slacks[:i] + batch.slacks[i + 1:], default=math.inf), slack)
            env.batch_size = len(batch.selected)
            if not step.cond(victim):
                return done
            batch.remove(i)
            batch.add(cand, step.cls, chunk, shape, slack)
        return len(candidates)


def _last_index(classes: list[int], cls: int) -> int | None:
    for i in range(len(classes) - 1, -1, -1):
        if classes[i] == cls:
            return i
    return None
