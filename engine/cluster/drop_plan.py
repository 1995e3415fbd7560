"""KunServe's drop plan (§4.1, Algorithm 6): which instances form pipeline groups so that the
KV memory freed by dropping replicated layers fits the queued demand.

Every instance holds a whole copy of the weights. A group of k instances needs one copy between
them, so each merge of two groups frees exactly one copy of the weights (`weight_blocks` KV
blocks). The planner merges the two smallest groups (fewest pipeline stages per request, the
cost §4.1 measures in Figure 5) until the free blocks cover the demand, and stops at the first
merge that makes it fit: no group is larger than it has to be, and the count of merges is the
least that fits. Plain and synchronous: the coordinator decides when, this answers how.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

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
              groups: Sequence[Sequence[int]] = ()) -> DropPlan | None:
    """Greedy grouping: start from the current `groups` (index tuples; unlisted instances are
    alone), merge the two smallest (ties: the lowest indices) while the demand exceeds the free
    blocks. None when even one group of every instance cannot hold it (the caller falls back to
    KV-centric preemption, §4.1). Pipeline groups need a layer per member, so a group never
    grows past `num_layers` members."""
    if weight_blocks < 0:
        raise ValueError(f"weight_blocks must be >= 0, got {weight_blocks}")
    by_index = {c.index: c for c in instances}
    start = [tuple(g) for g in groups if g]
    grouped = {i for g in start for i in g}
    start += [(c.index,) for c in instances if c.index not in grouped]
    free = sum(c.pool_blocks - c.used_blocks for c in instances)
    free += sum((len(g) - 1) * weight_blocks for g in start)
    demand = sum(c.queued_blocks for c in instances)
    heap = [(len(g), min(g), g) for g in start]
    heapq.heapify(heap)
    while free < demand:
        if len(heap) < 2 or weight_blocks == 0:
            return None
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        if a[0] + b[0] > num_layers:
            return None  # the smallest merge already needs more stages than layers
        members = _order(a[2] + b[2], by_index)
        heapq.heappush(heap, (len(members), min(members), members))
        free += weight_blocks
    plans = sorted((g for _, _, g in heap), key=min)
    out = tuple(GroupPlan(group_id=k, members=g, layers=stage_layers(num_layers, len(g)))
                for k, g in enumerate(plans))
    return DropPlan(groups=out, free_blocks=free, demand_blocks=demand)


def _order(members: tuple[int, ...], by_index: dict[int, InstanceCapacity]) -> tuple[int, ...]:
    """Pipeline order: the head is the member holding the most KV (its requests' KV for the
    layers it keeps need not move), then by index."""
    head = max(members, key=lambda i: (by_index[i].used_blocks if i in by_index else 0, -i))
    return (head,) + tuple(sorted(i for i in members if i != head))
