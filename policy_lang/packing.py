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
        batch.selected = batch.order()
        ids = batch.ids  # most requests are in the batch: asked first
        rest = [r for c in sorted(range(n), key=rank.__getitem__)
                for r in sorted_groups.get(c) or self._sort[c](groups[c])
                if r.id not in ids and r.state == "running"]
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
        """Take from `group` in order; returns the requests not taken (for `replaces`).

        Most tries are running requests' decodes (~90 of ~95 an iteration at 12 RT/s): those
        are tried here, `_try` written out for one new token of a running request (no memory
        to lend or reserve, one iteration to its token), since the call and `_try`'s branches
        for prompts cost about what the decode's test does. The same integers and floats as
        `_try`, so the same decisions (tests/policy_lang/test_pack_decodes.py)."""
        left: list[RequestView] = []
        late: list[tuple[RequestView, int]] = []
        selected, claimed, limit = batch.selected, lender.claimed, batch.limit
        entries, keys, ids = batch.entries, batch.keys, batch.ids
        cost, bs, now, cond, env = batch.cost, batch.block_size, batch.now, step.cond, self._env
        be_table, cls, key = batch.reverse_free is not None, step.cls, 2 * rank
        decode: list[bool] | None = None
        stopped = False
        for i, r in enumerate(group):
            if len(selected) >= limit or batch.tokens_left <= 0:  # batch.full(), which stays
                left += group[i:]  # so: only `_replace` takes requests out
                break
            if claimed and r.id in claimed:
                left.append(r)
                continue
            # remaining_tokens, read once (a property of a property)
            remaining = r.prompt_tokens + r.output_tokens - r.computed_tokens
            if remaining <= 1 and r.state == "running":  # a decode: `_try` written out
                start = r.computed_tokens
                need = -(-(start + 1) // bs) - r.blocks
                if need < 0:
                    need = 0
                if (be_table and selected and r.ttft_ms is None and r.tpot_ms is None
                        and batch.reverse_short(r, need)):
                    left.append(r)
                    continue
                copies = r.checkpointed_blocks
                pt, psq, ppre, ds, dc = batch.shape
                ds, dc = ds + 1, dc + start + 1
                est = (batch.average_ms if cost is None
                       else cost.iteration_of(pt, psq, ppre, ds, dc, batch.copy_blocks + copies))
                budget = (r.deadline - now) * 1000.0  # r.slack_ms(now) / its 1 iteration
                if budget < est:
                    late.append((r, remaining))
                    continue
                least = batch.min_slack
                if cond is not None:
                    env.est_iteration = est
                    env.min_slack = budget if budget < least else least  # min(least, budget)
                    env.batch_size = len(selected) + 1
                    if not cond(r):
                        self.violated = self.violated or step.violation
                        stopped = True
                        left += group[i:]
                        break
                if batch.reserved:
                    batch.unreserve(r.id)
                if be_table and (need or copies):  # batch.add, inline
                    take = batch.reverse_need(r, need)
                    batch.reverse_free = max(0, batch.reverse_free - take)
                else:
                    take = 0
                selected.append(r)
                entries.append((cls, (start, 1), need, budget, copies, take))
                keys.append(key)
                batch.copy_blocks += copies
                ids.add(r.id)
                batch.shape = [pt, psq, ppre, ds, dc]
                batch.tokens_left -= 1
                batch.free -= need
                if budget < least:
                    batch.min_slack = budget
                continue
            if remaining > 1:  # the only tries that read the decode reserve: decodes of this
                # class not yet tried, which a prompt chunk leaves a token each (§4.1 bounds a
                # batch by B requests and the iteration time, never by tokens, so a decode must
                # not lose its place to a chunk of a prompt that can be cut)
                if decode is None:
                    decode = [q.prompt_tokens + q.output_tokens - q.computed_tokens == 1
                              and q.state == "running" for q in group]
                batch.decode_reserve = max(0, min(sum(decode[i + 1:]), limit - len(selected) - 1))
            verdict = self._try(batch, step, r, remaining, lender, rank, False)
            if verdict is TAKEN:
                continue
            if verdict is LATE:
                late.append((r, remaining))
            elif verdict is STOP:
                stopped = True
                left += group[i:]
                break
            else:
                left.append(r)
        batch.decode_reserve = 0
        for r, n in late:  # requests that cannot make their deadline: after those that can
            if (stopped or batch.full()
                    or self._try(batch, step, r, n, lender, rank, True) is not TAKEN):
                left.append(r)
        return left

    def _try(self, batch: Batch, step: Take, r: RequestView, remaining: int, lender: Lender,
             rank: int, late_ok: bool) -> str:
        # batch.chunk, batch.need, batch.iterations, copies_of, plus and batch.predict inline:
        # this runs per request per iteration (the same integers, so the same predictions)
        start = r.computed_tokens
        if remaining > 1:
            room = batch.tokens_left - batch.decode_reserve
            if room <= 0:
                return SKIP  # the tokens left are the decodes' behind it
            n = remaining if remaining < room else room
        elif batch.tokens_left <= 0:
            return SKIP
        else:
            n = 1
        need = -(-(start + n) // batch.block_size) - r.blocks
        if need < 0:
            need = 0
        state = r.state
        admits = n > 1 or state != "running"
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
        budget = (r.deadline - batch.now) * 1000.0 / (  # r.slack_ms(now)
            1 + (-(-rest // batch.budget_tokens) if rest > 0 else 0))
        if budget < est:
            if not late_ok:
                if admits:
                    batch.reserve(r.id, step.cls, max(0, min(need, free)))
                return LATE
            budget = math.inf
        if step.cond is not None:
            env, least = self._env, batch.min_slack
            env.est_iteration = est
            env.min_slack = budget if budget < least else least  # min(least, budget)
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
        # batch.add, inline (a call per request taken cost about what it does)
        take = 0
        if batch.reverse_free is not None and (need or r.checkpointed_blocks):
            take = batch.reverse_need(r, need)
            batch.reverse_free = max(0, batch.reverse_free - take)
        batch.selected.append(r)
        batch.entries.append((step.cls, (start, n), need, budget, copies, take))
        batch.keys.append(2 * rank + (remaining > 1))
        batch.copy_blocks += copies
        batch.ids.add(r.id)
        batch.shape = shape
        batch.tokens_left -= n
        batch.free -= need
        if budget < batch.min_slack:
            batch.min_slack = budget
        return TAKEN

    def _replace(self, batch: Batch, step: Replace,
                 candidates: list[RequestView]) -> list[RequestView]:
        env, key = self._env, 2 * self._pack_rank[step.cls]
        for done, cand in enumerate(candidates):
            i = batch.last_of(step.victim)
            if i is None:
                return candidates[done:]
            victim = batch.selected[i]
            if victim.id in batch.borrowers:  # its memory comes from BE requests left out
                return candidates[done:]
            if cand.id in batch.lent:
                continue
            _, victim_chunk, victim_need, victim_budget, victim_copies, victim_take = \
                batch.entries[i]
            chunk = batch.chunk(cand, extra_tokens=victim_chunk[1])
            if chunk[1] < cand.remaining_tokens:
                continue  # a sliver of a prompt in a decode's place serves nobody
            need = batch.need(cand, chunk)
            if need > batch.free + victim_need or batch.reverse_short(cand, need, victim_take):
                continue  # BE takes no memory from RT
            copies = copies_of(cand)
            shape = plus(plus(batch.shape, chunk, 1), victim_chunk, -1)
            est = batch.predict(shape, copies - victim_copies)
            budget = cand.slack_ms(env.view.now) / batch.iterations(cand, chunk)
            budget = budget if budget >= est else math.inf
            env.est_iteration = est
            env.min_slack = min(batch.min_slack_without(i, victim_budget), budget)
            env.batch_size = len(batch.selected)
            if not step.cond(victim):
                return candidates[done:]
            batch.remove(i)
            batch.add(cand, step.cls, chunk, need, budget, copies, shape,
                      key + (cand.remaining_tokens > 1))
        return []
