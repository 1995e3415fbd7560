"""KunServe's drop plan (§4.1, Algorithm 6): which instances form pipeline groups so that the
KV memory freed by dropping replicated layers fits the queued demand.

Every instance holds a whole copy of the weights. A group of k instances needs one copy between
them, so each merge of two groups frees exactly one copy of the weights (`weight_blocks` KV
blocks). Demand is counted where it waits: a group fits when its members' free blocks (plus the
weights they dropped) hold its members' queued demand. While some group does not fit, the
planner merges the smallest such group with the smallest other group (fewest pipeline stages per
request, the cost §4.1 measures in Figure 5), and stops once every group fits: an instance
overloaded while others still have free memory gets a partner (Algorithm 6 run on the overloaded
instance's demand), groups that fit are left alone (no unnecessary cooperation), and no group is
larger than it has to be. Plain and synchronous: the coordinator decides when, this answers how.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

from engine.cluster.plan import stage_layers


@attrs.frozen(kw_only=True)
class GroupPlan:
    """One pipeline group: `members` in pipeline order (`members[0]` is the head, whose engine
    schedules the group), `layers[i]` the contiguous layers member i keeps. A group of one is an
    instance serving alone with every layer."""

    group_id: int
    members: tuple[int, ...]
    layers: tuple[range, ...]

    @property
    def head(self) -> int:
        return self.members[0]

    @property
    def size(self) -> int:
        return len(self.members)


@attrs.frozen(kw_only=True)
class InstanceCapacity:
    """One live instance as the planner sees it, in whole-model KV blocks of its own pool."""

    index: int
    pool_blocks: int
    """Its KV pool serving alone (the pre-drop capacity)."""
    used_blocks: int
    """Blocks its running requests hold."""
    queued_blocks: int
    """Blocks its queued (head-of-line) requests need to run."""


@attrs.frozen(kw_only=True)
class DropPlan:
    groups: tuple[GroupPlan, ...]
    """Every live instance in exactly one group (groups of one included)."""
    free_blocks: int
    """Free blocks across the cluster once the plan is carried out."""
    demand_blocks: int

    def group_of(self, index: int) -> GroupPlan:
        return next(g for g in self.groups if index in g.members)

    @property
    def merged(self) -> tuple[GroupPlan, ...]:
        return tuple(g for g in self.groups if g.size > 1)


def group_pool(pools: Sequence[int], weight_blocks: int) -> int:
    """KV blocks of a group whose members alone had `pools`: one copy of the weights serves
    them all, so every member but one gives its copy to the KV pool."""
    return sum(pools) + (len(pools) - 1) * weight_blocks


def plan_drop(instances: Sequence[InstanceCapacity], *, num_layers: int, weight_blocks: int,
              groups: Sequence[Sequence[int]] = (),
              pool: Callable[[Sequence[int]], int] | None = None) -> DropPlan | None:
    """Greedy grouping: start from the current `groups` (index tuples; unlisted instances are
    alone); while a group's queued demand exceeds its free blocks, merge the smallest such group
    (ties: the lowest index) with the smallest other group. None when a group that does not fit
    cannot grow any more: one group of every instance cannot hold the demand, or the merge would
    need more stages than the model has layers (the caller falls back to KV-centric preemption,
    §4.1). `pool` gives the KV blocks of a group whose members alone had these pools (pipeline
    order); by default `group_pool`, which an uneven torch group falls short of (its stride
    wastes blocks: sim/arena_layout.py `group_pool_blocks`)."""
    if weight_blocks < 0:
        raise ValueError(f"weight_blocks must be >= 0, got {weight_blocks}")
    by_index = {c.index: c for c in instances}
    start = [tuple(i for i in g if i in by_index) for g in groups]
    start = [g for g in start if g]
    grouped = {i for g in start for i in g}
    current = start + [(c.index,) for c in instances if c.index not in grouped]

    def free(g: tuple[int, ...]) -> int:
        pools = [by_index[i].pool_blocks for i in g]
        whole = pool(pools) if pool is not None and len(g) > 1 else group_pool(pools, weight_blocks)
        return whole - sum(by_index[i].used_blocks for i in g)

    def demand(g: tuple[int, ...]) -> int:
        return sum(by_index[i].queued_blocks for i in g)

    while short := [g for g in current if free(g) < demand(g)]:
        a = min(short, key=lambda g: (len(g), min(g)))
        others = [g for g in current if g is not a]
        if not others:
            return None
        b = min(others, key=lambda g: (len(g), min(g)))
        if len(a) + len(b) > num_layers:
            return None  # the smallest merge already needs more stages than layers
        current = [g for g in current if g is not a and g is not b]
        current.append(_order(a + b, by_index))
    plans = sorted(current, key=min)
    out = tuple(GroupPlan(group_id=k, members=g, layers=stage_layers(num_layers, len(g)))
                for k, g in enumerate(plans))
    return DropPlan(groups=out, free_blocks=sum(free(g) for g in plans),
                    demand_blocks=sum(demand(g) for g in plans))


class QueueStats(Protocol):
    waiting: int
    queued_tokens: int
    free_blocks: int


def queue_moves(stats: Sequence[QueueStats | None], *, block_size: int, grouped: set[int],
                heads: Sequence[int], alive: Sequence[bool]) -> list[tuple[int, int]]:
    """Where queued requests go while groups run (§4.1: queued requests are rescheduled onto
    the enlarged memory): each live instance serving alone whose queued demand exceeds its
    free memory sends its queue to the group head with the most free blocks, if that head can
    hold it and has no queue of its own (moved there, the requests would only wait in another
    queue; the instance, still overloaded, is left to the drop trigger and Algorithm 6 groups
    it: measured with the simulator's manager on azure-conv 1x). Returns (instance, head)
    pairs; `stats[i]` is None for an instance that did not answer. Both group managers
    (simulated and torch instances) move by this rule."""
    live_heads = [h for h in heads if stats[h] is not None and alive[h]
                  and not stats[h].waiting]
    moves = []
    for i, st in enumerate(stats):
        if i in grouped or st is None or not alive[i] or not st.waiting:
            continue
        if st.queued_tokens <= st.free_blocks * block_size:
            continue
        best = max(live_heads, key=lambda h: stats[h].free_blocks, default=None)
        if best is not None and stats[best].free_blocks * block_size >= st.queued_tokens:
            moves.append((i, best))
    return moves


def _order(members: tuple[int, ...], by_index: dict[int, InstanceCapacity]) -> tuple[int, ...]:
    """Pipeline order: the head is the member holding the most KV (its requests' KV for the
    layers it keeps need not move), then by index."""
    head = max(members, key=lambda i: (by_index[i].used_blocks if i in by_index else 0, -i))
    return (head,) + tuple(sorted(i for i in members if i != head))
