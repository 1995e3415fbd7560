"""Priority-based packing (BROS §4.2, Alg. 1): build this iteration's batch class by class.

- `rt while COND`: take RT requests in their priority order (ascending slack) while COND holds
  for the batch with the next one in it; the first that fails stops the class and counts as a
  predicted violation (Alg. 1 lines 11-12, which resets an adaptive batch size);
- `be fill [while COND]`: take BE requests while the batch has room (and COND holds);
- `be replaces rt when COND`: each BE request left over replaces the least urgent RT request
  in the batch, as long as COND holds for that RT request.

The SLO constraint is (6) of §4.1: a request's current token needs `r` more iterations (the
rest of its prefill in chunks of the token budget, or one decode) and makes its deadline if
`r * est_iteration <= slack`. So `min_slack` is the tightest per-iteration budget, `slack / r`,
among the batch's requests that can still make their deadline. A request that cannot (its
budget is below the predicted iteration) is deferred behind the class's requests that can, and
does not count toward `min_slack`: it would otherwise block every other request and, its slack
never recovering, starve itself and the rest (issue 14's thrashing).

Memory is checked while packing (FindBlock / FindPreemptBlock): a waiting request joins only if
its next chunk's blocks are free or held by running requests of a class packed later (RT may
take BE memory, never the reverse, and never another RT request's: displacing running RT
requests by recompute to admit new ones is what made the shipped policy thrash). A request that
does not fit is skipped, so BE requests behind it still run; the free blocks it waits for are
held back from newer requests of its own class, which would otherwise starve it.

Request pulling (§4.2, Fig. 8): each class's pending requests (running, swapped) are sorted;
its waiting queue is already in arrival order, which for one class's TTFT is deadline order, so
the two runs merge in linear time (one sort: `_pull`); requests are then pulled until the batch
is full, and each is tried once (`_try` reads the batch's sums, never the batch).

The decision's order is the batch, then the running requests left out (ranked, so the planner
preempts the least deserving first: BE before RT). The iteration time is predicted by the
engine's cost model (engine/cost_model.py); only an engine without one falls back to the moving
average of observed iteration times (BROS Table 1). The batch being built, with its predicted
shape kept summed, is policy_lang/pack_batch.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from engine.policy import RequestView, SchedulerView
from policy_lang.pack_batch import Batch, Lender, copies_of, plus

Condition = Callable[[RequestView], Any]
TAKEN, SKIP, LATE, STOP = "taken", "skip", "late", "stop"
"""`_try`'s verdicts."""


class Env:
    """What pack conditions and engine statistics read; set before each evaluation."""

    __slots__ = ("_counts", "batch_size", "est_iteration", "min_slack", "view")

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


class PackOrder:
    """The order is the packed batch, then the running requests left out; `batch` says how many
    lead it and `violated` whether packing predicted a miss."""

    def __init__(self, *, split: Callable[[Sequence[RequestView]], list[list[RequestView]]],
                 sort: list[Callable[[list[RequestView]], list[RequestView]]],
                 steps: Sequence[Take | Replace], env: Env, timer: IterationTimer) -> None:
        self._split, self._sort, self._steps = split, sort, steps
        self._env, self._timer = env, timer
        ranks: dict[int, int] = {}
        for s in steps:
            ranks.setdefault(s.cls, len(ranks))
        self._pack_rank = ranks
        self.violated = False
        self.batch = 0

    def __call__(self, view: SchedulerView, limit: int | None) -> list[RequestView]:
        self.violated = False
        groups = self._split(view.requests)
        n = len(groups)
        rank = [self._pack_rank.get(c, len(self._pack_rank)) for c in range(n)]
        lender = Lender(groups, rank)
        sorted_groups: dict[int, list[RequestView]] = {}
        left: dict[int, list[RequestView]] = {}
        batch = Batch(view, view.cost, self._timer.average_ms, limit or view.max_num_seqs)
        for step in self._steps:
            if isinstance(step, Take):
                group = sorted_groups.get(step.cls)
                if group is None:
                    group = sorted_groups[step.cls] = self._pull(step.cls, groups[step.cls])
                left[step.cls] = self._take(batch, step, group, lender, rank[step.cls])
            else:
                left[step.cls] = self._replace(batch, step, left.get(step.cls, []))
        self.batch = len(batch.selected)
        # the planner gives running requests their tokens in batch order: within a class,
        # decodes before prompt chunks, so each gets the tokens packing counted for it
        packed = sorted(zip(batch.selected, batch.classes), key=lambda t: (
            rank[t[1]], t[0].prompt_tokens + t[0].output_tokens - t[0].computed_tokens > 1))
        batch.selected = [r for r, _ in packed]
        rest = [r for c in sorted(range(n), key=rank.__getitem__)
                for r in sorted_groups.get(c) or self._sort[c](groups[c])
                if r.state == "running" and r.id not in batch.ids]
        return batch.selected + rest

    def _pull(self, cls: int, group: list[RequestView]) -> list[RequestView]:
        """Pending requests, then the waiting queue (in arrival order, which for one class's
        TTFT is deadline order), sorted as one list: timsort finds the waiting run already in
        order and merges the two in linear time, each key computed once. The same order as
        sorting each and merging them (a stable sort by one order keeps pending before waiting
        on ties and each in its own order), which computed every key three times."""
        pending = [r for r in group if r.state != "waiting"]
        if not pending or len(pending) == len(group):
            return self._sort[cls](group)
        return self._sort[cls](pending + [r for r in group if r.state == "waiting"])

    def _take(self, batch: Batch, step: Take, group: list[RequestView], lender: Lender,
              rank: int) -> list[RequestView]:
        """Take from `group` in order; returns the requests not taken (for `replaces`)."""
        left: list[RequestView] = []
        late: list[tuple[RequestView, int]] = []
        # remaining_tokens, read once per request (a property of a property: this runs per
        # request per iteration); decodes of this class not yet tried: a prompt chunk leaves
        # them a token each (§4.1 bounds a batch by B requests and the iteration time, never by
        # tokens, so a decode must not lose its place to a chunk of a prompt that can be cut)
        remaining = [r.prompt_tokens + r.output_tokens - r.computed_tokens for r in group]
        decode = [n == 1 and r.state == "running" for r, n in zip(group, remaining)]
        decodes, selected, claimed = sum(decode), batch.selected, lender.claimed
        stopped = False
        for i, r in enumerate(group):
            decodes -= decode[i]
            if len(selected) >= batch.limit or batch.tokens_left <= 0:  # batch.full(), which
                left += group[i:]  # stays so: only `_replace` takes requests out
                break
            if r.id in claimed:
                left.append(r)
                continue
            if remaining[i] > 1:  # the only tries that read it
                batch.decode_reserve = max(0, min(decodes, batch.limit - len(selected) - 1))
            verdict = self._try(batch, step, r, remaining[i], lender, rank, late_ok=False)
            if verdict is TAKEN:
                continue
            if verdict is LATE:
                late.append((r, remaining[i]))
            elif verdict is STOP:
                stopped = True
                left += group[i:]
                break
            else:
                left.append(r)
        batch.decode_reserve = 0
        for r, n in late:  # requests that cannot make their deadline: after those that can
            if (stopped or batch.full()
                    or self._try(batch, step, r, n, lender, rank, late_ok=True) is not TAKEN):
                left.append(r)
        return left

    def _try(self, batch: Batch, step: Take, r: RequestView, remaining: int, lender: Lender,
             rank: int, late_ok: bool) -> str:
        # batch.chunk, batch.need, batch.iterations, copies_of, plus and batch.predict inline:
        # this runs per request per iteration (the same integers, so the same predictions)
        start = r.computed_tokens
        room = batch.tokens_left - (batch.decode_reserve if remaining > 1 else 0)
        if room <= 0:
            return SKIP  # the tokens left are the decodes' behind it
        n = max(1, min(remaining, room))
        need = max(0, -(-(start + n) // batch.block_size) - r.blocks)
        state = r.state
        admits = state != "running" or n > 1
        free = 0
        if admits:
            # FindPreemptBlock: only classes packed later lend memory for a new request or a
            # prefill chunk; a decode grows into what the planner frees for it (vLLM's rule)
            free = batch.free - batch.held.get(step.cls, 0) + batch.reserved.get(r.id, (0, 0))[1]
            if need > free and need > free + lender.available(rank):
                batch.reserve(r.id, step.cls, max(0, min(need, free)))
                return SKIP
        # a BE request short of wholly free blocks waits, unless nothing else runs: then it
        # goes first and its step swaps others out (§5.2's extreme case), or BE requests that
        # all wait for free blocks held by each other would wait forever (96-block pool)
        if (batch.reverse_free is not None and batch.selected and r.ttft_ms is None
                and r.tpot_ms is None and batch.reverse_short(r, need)):  # BE only: no call for RT
            return SKIP
        copies = r.swapped_blocks if state == "swapped" else r.checkpointed_blocks
        pt, psq, ppre, ds, dc = batch.shape
        shape = ([pt, psq, ppre, ds + 1, dc + start + 1] if n == 1
                 else [pt + n, psq + n * n, ppre + n * start, ds, dc])
        cost = batch.cost
        est = (batch.average_ms if cost is None
               else cost.iteration_of(*shape, batch.copy_blocks + copies))
        rest = remaining - n
        budget = (r.deadline - self._env.view.now) * 1000.0 / (  # r.slack_ms(now)
            1 + (-(-rest // batch.budget_tokens) if rest > 0 else 0))
        if budget < est:
            if not late_ok:
                if admits:
                    batch.reserve(r.id, step.cls, max(0, min(need, free)))
                return LATE
            budget = math.inf
        if step.cond is not None:
            env = self._env
            env.est_iteration = est
            env.min_slack = min(batch.min_slack, budget)
            env.batch_size = len(batch.selected) + 1
            if not step.cond(r):
                self.violated = self.violated or (step.violation and not late_ok)
                return STOP
        if need > free and admits:
            lender.claim(rank, need - free, batch.ids)
            batch.free += need - free  # the claimed blocks, freed for r by the planner
            batch.borrowers.add(r.id)
            batch.lent = lender.claimed
        if batch.reserved:
            batch.unreserve(r.id)
        batch.add(r, step.cls, (start, n), need, budget, copies, shape)
        return TAKEN

    def _replace(self, batch: Batch, step: Replace,
                 candidates: list[RequestView]) -> list[RequestView]:
        env = self._env
        for done, cand in enumerate(candidates):
            i = _last_index(batch.classes, step.victim)
            if i is None:
                return candidates[done:]
            victim = batch.selected[i]
            if victim.id in batch.borrowers:  # its memory comes from BE requests left out
                return candidates[done:]
            if cand.id in batch.lent:
                continue
            chunk = batch.chunk(cand, extra_tokens=batch.chunks[i][1])
            if chunk[1] < cand.remaining_tokens:
                continue  # a sliver of a prompt in a decode's place serves nobody
            need = batch.need(cand, chunk)
            if need > batch.free + batch.needs[i] or batch.reverse_short(
                    cand, need, batch.reverse_takes[i]):
                continue  # BE takes no memory from RT
            copies = copies_of(cand)
            shape = plus(plus(batch.shape, chunk, 1), batch.chunks[i], -1)
            est = batch.predict(shape, copies - batch.copies[i])
            budget = cand.slack_ms(env.view.now) / batch.iterations(cand, chunk)
            budget = budget if budget >= est else math.inf
            env.est_iteration = est
            env.min_slack = min(min(batch.budgets[:i] + batch.budgets[i + 1:], default=math.inf),
                                budget)
            env.batch_size = len(batch.selected)
            if not step.cond(victim):
                return candidates[done:]
            batch.remove(i)
            batch.add(cand, step.cls, chunk, need, budget, copies, shape)
        return []


def _last_index(classes: list[int], cls: int) -> int | None:
    for i in range(len(classes) - 1, -1, -1):
        if classes[i] == cls:
            return i
    return None
