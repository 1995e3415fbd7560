"""KunServe's global monitor (§4.1, §4.4): the cluster's load as the policy's `overload`
conditions read it, and what the coordinator does when they fire.

`ClusterLoad` has the engine statistics an overload condition may name, summed over the live
instances: `kv_usage` is the memory demand (KV in use plus the KV queued requests need) against
the capacity the cluster had before any drop (§4.4: restore thresholds are measured against
the pre-drop capacity, not the grown pools);
`free_blocks`/`free_tokens` are what is free now (grown pools included); `queued_tokens` is the
head-of-line demand (the KV the requests not running need). `OverloadMonitor` evaluates the
policy's triggers on it once per monitor round and answers with an action: a drop plan by greedy
grouping (engine/cluster/drop_plan.py), or the groups to restore. Plain and synchronous.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import attrs

from engine.cluster.dispatch import InstanceStats
from engine.cluster.drop_plan import DropPlan, GroupPlan, InstanceCapacity, plan_drop


class _Counted(NamedTuple):
    state: str


@attrs.frozen(kw_only=True)
class ClusterLoad:
    iteration: int
    """The monitor round (a `for N iterations` hold counts rounds)."""
    used_blocks: int
    free_blocks: int
    total_blocks: int
    """The pre-drop capacity: every live instance's pool serving alone."""
    block_size: int
    queued_tokens: int
    waiting: int
    running: int
    last_iteration_ms: float = 0.0

    @property
    def kv_usage(self) -> float:
        """Memory demand (§2.2, as Llumnix counts it): the KV held plus the KV the queued
        requests need, over the pre-drop capacity; above 1 when demand exceeds it."""
        if not self.total_blocks:
            return 0.0
        return (self.used_blocks + self.queued_tokens / self.block_size) / self.total_blocks

    @property
    def free_tokens(self) -> int:
        return self.free_blocks * self.block_size

    @property
    def requests(self) -> tuple[_Counted, ...]:
        """What `waiting`/`running` conditions count (the policy runtime counts states)."""
        return (_Counted("waiting"),) * self.waiting + (_Counted("running"),) * self.running


@attrs.frozen(kw_only=True)
class Drop:
    plan: DropPlan
    new_groups: tuple[GroupPlan, ...]
    """Groups of the plan that are not running yet (to form, or to grow)."""


@attrs.frozen(kw_only=True)
class Restore:
    heads: tuple[int, ...]
    """Groups (by head) whose head can hold all its requests in its own pool again."""


Action = Drop | Restore | None
Signal = Callable[[ClusterLoad], str | None]
"""The policy's overload triggers (`CompiledPolicy.overload_signal`)."""


class OverloadMonitor:
    def __init__(self, *, base_pools: Sequence[int], block_size: int, num_layers: int,
                 weight_blocks: int, signal: Signal,
                 rearm: Callable[[], None] = lambda: None) -> None:
        self.base_pools = list(base_pools)
        self.block_size = block_size
        self.num_layers = num_layers
        self.weight_blocks = weight_blocks
        """KV blocks one copy of the weights becomes when dropped (§4.1)."""
        self._signal = signal
        self.rearm = rearm
        """Keeps the restore trigger armed when a restore could not be done yet (the policy's
        triggers stop evaluating `restore` once it fired)."""
        self.groups: dict[int, GroupPlan] = {}
        """Running groups of more than one instance, by head."""
        self.rounds = 0
        self.refused = 0
        """Drops the policy asked for that no grouping could fit (KV-centric fallback, §4.1)."""

    def member_of(self, index: int) -> int | None:
        """The head serving for `index`, when it is a non-head member of a group."""
        for head, g in self.groups.items():
            if index in g.members and index != head:
                return head
        return None

    def load(self, stats: Sequence[InstanceStats | None], alive: Sequence[bool]) -> ClusterLoad:
        used = free = queued = waiting = running = 0
        total = 0
        ms = 0.0
        for i, st in enumerate(stats):
            if not alive[i]:
                continue
            total += self.base_pools[i]
            if st is None or self.member_of(i) is not None:
                continue  # a member's requests and memory are its head's
            used += st.total_blocks - st.free_blocks
            free += st.free_blocks
            queued += st.queued_tokens
            waiting += st.waiting
            running += st.running
            ms = max(ms, st.iteration_ms)
        self.rounds += 1
        return ClusterLoad(iteration=self.rounds, used_blocks=used, free_blocks=free,
                           total_blocks=total, block_size=self.block_size, queued_tokens=queued,
                           waiting=waiting, running=running, last_iteration_ms=ms)

    def decide(self, stats: Sequence[InstanceStats | None], alive: Sequence[bool]) -> Action:
        load = self.load(stats, alive)
        signal = self._signal(load)
        if signal == "drop":
            return self._drop(stats, alive)
        if signal == "restore" and self.groups:
            heads = tuple(h for h, g in self.groups.items()
                          if stats[h] is not None
                          and stats[h].total_blocks - stats[h].free_blocks <= self.base_pools[h])
            if heads:
                return Restore(heads=heads)
            self.rearm()
        return None

    def _drop(self, stats: Sequence[InstanceStats | None], alive: Sequence[bool]) -> Drop | None:
        bs = self.block_size
        caps = []
        for i, st in enumerate(stats):
            if not alive[i] or st is None:
                continue
            member = self.member_of(i) is not None
            # a head's blocks live in its group's pool: the planner adds the members' pools
            # and the freed weights back, so its free blocks come out as the head's
            used = 0 if member else st.total_blocks - st.free_blocks
            caps.append(InstanceCapacity(
                index=i, pool_blocks=self.base_pools[i], used_blocks=used,
                queued_blocks=0 if member else -(-st.queued_tokens // bs)))
        plan = plan_drop(caps, num_layers=self.num_layers, weight_blocks=self.weight_blocks,
                         groups=[g.members for g in self.groups.values()])
        if plan is None:
            self.refused += 1
            return None
        running = {g.members for g in self.groups.values()}
        new = tuple(g for g in plan.merged if g.members not in running)
        return Drop(plan=plan, new_groups=new) if new else None

    def formed(self, group: GroupPlan) -> None:
        for head in [h for h, g in self.groups.items() if set(g.members) & set(group.members)]:
            del self.groups[head]
        self.groups[group.head] = group

    def restored(self, head: int) -> None:
        self.groups.pop(head, None)
