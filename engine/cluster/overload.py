"""KunServe's global monitor (§4.1, §4.4): each serving unit's load as the policy's `overload`
conditions read it, and what the coordinator does when they fire.

`ClusterLoad` has the engine statistics an overload condition may name, for one unit (an
instance alone, or a group read at its head): `kv_usage` is the memory demand (KV in use plus
the KV queued requests need) against the capacity the unit had before any drop (§4.4: restore
thresholds are measured against the pre-drop capacity, not the grown pool);
`free_blocks`/`free_tokens` are what is free now (a group's grown pool included);
`queued_tokens` is the queued demand (the KV the requests not running need) and `head_tokens`
the oldest queued request's (above `free_tokens`, memory rather than the token budget holds the
queue); `pending_tokens` is the running demand (the KV running requests still need for their
prompts: KV is reserved chunk by chunk, so prompts admitted into too little memory are
preempted mid-prefill and recomputed, with nobody left waiting for the head-of-line rule to see). `OverloadMonitor` evaluates the policy's triggers on each unit once per monitor round
and answers with an action: a drop plan by greedy grouping (engine/cluster/drop_plan.py), or
the groups to restore. Plain and synchronous.
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
    now: float = 0.0
    """The monitor's clock at the round, seconds (a `for 2s` hold reads it): virtual time in
    the simulator, real time on torch instances."""
    used_blocks: int
    free_blocks: int
    total_blocks: int
    """The pre-drop capacity: the unit's members' pools serving alone."""
    block_size: int
    queued_tokens: int
    head_tokens: int = 0
    pending_tokens: int = 0
    waiting: int
    running: int
    last_iteration_ms: float = 0.0

    @property
    def kv_usage(self) -> float:
        """Memory demand (§2.2, as Llumnix counts it): the KV held plus the KV the running
        requests' prompts and the queued requests still need, over the pre-drop capacity;
        above 1 when demand exceeds it."""
        if not self.total_blocks:
            return 0.0
        need = self.queued_tokens + self.pending_tokens
        return (self.used_blocks + need / self.block_size) / self.total_blocks

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


@attrs.frozen(kw_only=True)
class Trigger:
    """One compiled copy of the policy's `overload` triggers (they keep state: how many rounds
    a condition has held, whether a drop fired)."""

    signal: Signal
    rearm: Callable[[], None]
    """Keep the restore trigger armed (the triggers stop evaluating `restore` once it fired,
    and a group formed for another instance's overload never fired its head's drop)."""


CLUSTER = -1
"""The key of the triggers evaluated on the whole cluster (restore, §4.4)."""

TriggerFactory = Callable[[], Trigger]
"""Compiles a fresh copy of the running policy's triggers (one per serving unit)."""


def dissolve_only() -> Trigger:
    """The triggers of a policy that has none, replacing one that had: nothing drops, and the
    groups still running dissolve once their heads' requests fit their own pools."""
    return Trigger(signal=lambda load: "restore", rearm=lambda: None)


class OverloadMonitor:
    """Evaluates the policy's drop trigger once per monitor round on every serving unit: an
    instance alone, or a group by its head (§4.1: the monitor computes each instance's load, so
    one instance's overload is seen while others still have free memory). A unit's load is its
    own: its held and queued KV against its pre-drop capacity (the sum of its members' pools
    alone). Any unit's drop asks the planner for groups in which every unit holds its queue.
    The restore trigger reads the whole cluster (§4.4: "when the monitor detects that the total
    KVCache usage is below a threshold"); it dissolves the groups whose heads' requests fit
    their own pools."""

    def __init__(self, *, base_pools: Sequence[int], block_size: int, num_layers: int,
                 weight_blocks: int, triggers: TriggerFactory,
                 pool: Callable[[Sequence[int]], int] | None = None) -> None:
        self.base_pools = list(base_pools)
        self.block_size = block_size
        self.num_layers = num_layers
        self.weight_blocks = weight_blocks
        """KV blocks one copy of the weights becomes when dropped (§4.1)."""
        self.pool = pool
        """The KV blocks of a group whose members alone had these pools (pipeline order, the
        layers split as `stage_layers` splits them), as the group manager will size it: the
        planner sizes groups with it. None: the pools plus `weight_blocks` a member past the
        first (drop_plan.py `group_pool`), which an uneven torch group falls short of (its
        stride wastes blocks: sim/arena_layout.py `group_pool_blocks`)."""
        self._make = triggers
        self._triggers: dict[int, Trigger] = {}
        """Each unit's own triggers, by the instance heading it."""
        self.groups: dict[int, GroupPlan] = {}
        """Running groups of more than one instance, by head."""
        self.rounds = 0
        self.refused = 0
        """Drops the policy asked for that no grouping could fit (KV-centric fallback, §4.1)."""
        self.head_only_plans = 0
        """Drops planned for the units' oldest queued requests, the whole queues fitting no
        grouping (see `_drop`)."""
        self.fired: list[int] = []
        """The units whose drop trigger fired in the last round (the bench's events)."""
        self.now = 0.0
        """The clock at the last round (`decide`'s `now`)."""

    def trigger(self, index: int) -> Trigger:
        if index not in self._triggers:
            self._triggers[index] = self._make()
        return self._triggers[index]

    def replace_triggers(self, triggers: TriggerFactory) -> None:
        """A new policy's triggers from the next round (policy replaced at run time); running
        groups keep the restore trigger armed."""
        self._make, self._triggers = triggers, {}
        self.rearm()

    def rearm(self) -> None:
        """Groups are running (or a restore could not be done yet): the cluster's restore
        trigger stays armed."""
        if self.groups:
            self.trigger(CLUSTER).rearm()

    def member_of(self, index: int) -> int | None:
        """The head serving for `index`, when it is a non-head member of a group."""
        for head, g in self.groups.items():
            if index in g.members and index != head:
                return head
        return None

    def load(self, index: int, st: InstanceStats) -> ClusterLoad:
        """The load of the unit `index` heads (alone or a group's head)."""
        g = self.groups.get(index)
        members = g.members if g is not None else (index,)
        return ClusterLoad(
            iteration=self.rounds, now=self.now, used_blocks=st.total_blocks - st.free_blocks,
            free_blocks=st.free_blocks, total_blocks=sum(self.base_pools[m] for m in members),
            block_size=self.block_size, queued_tokens=st.queued_tokens,
            head_tokens=st.head_tokens, pending_tokens=st.pending_tokens, waiting=st.waiting,
            running=st.running, last_iteration_ms=st.iteration_ms)

    def cluster_load(self, stats: Sequence[InstanceStats | None],
                     alive: Sequence[bool]) -> ClusterLoad:
        """The whole cluster's load, summed over the serving units, against the capacity every
        live instance had alone (what the restore trigger reads, §4.4: "the total KVCache
        usage")."""
        units = [self.load(i, st) for i, st in enumerate(stats)
                 if alive[i] and st is not None and self.member_of(i) is None]
        return ClusterLoad(
            iteration=self.rounds, now=self.now, used_blocks=sum(u.used_blocks for u in units),
            free_blocks=sum(u.free_blocks for u in units),
            total_blocks=sum(p for p, a in zip(self.base_pools, alive) if a),
            block_size=self.block_size, queued_tokens=sum(u.queued_tokens for u in units),
            head_tokens=max((u.head_tokens for u in units), default=0),
            pending_tokens=sum(u.pending_tokens for u in units),
            waiting=sum(u.waiting for u in units), running=sum(u.running for u in units),
            last_iteration_ms=max((u.last_iteration_ms for u in units), default=0.0))

    def dissolving(self, alive: Sequence[bool]) -> set[int]:
        """Instances of groups that lost a member (§4.4, faults): the survivors reload their
        dropped layers until the group manager reports the group `restored`; meanwhile no plan
        may group them (a drop planned then would take a reloading survivor into a new group,
        or the lost instance with it)."""
        return {m for g in self.groups.values() if not all(alive[i] for i in g.members)
                for m in g.members}

    def decide(self, stats: Sequence[InstanceStats | None], alive: Sequence[bool], *,
               now: float = 0.0) -> Action:
        """One monitor round at time `now` (seconds on the caller's clock)."""
        self.rounds += 1
        self.now = now
        out = self.dissolving(alive)
        drop = []
        for i, st in enumerate(stats):
            if not alive[i] or st is None or i in out or self.member_of(i) is not None:
                continue
            if self.trigger(i).signal(self.load(i, st)) == "drop":  # a unit's restore: unused
                drop.append(i)
        self.fired = drop
        if drop:
            action = self._drop(stats, alive, out)
            if action is not None:
                return action
        if not self.groups:
            return None
        if self.trigger(CLUSTER).signal(self.cluster_load(stats, alive)) != "restore":
            return None
        heads = tuple(h for h, g in self.groups.items() if h not in out and stats[h] is not None
                      and stats[h].total_blocks - stats[h].free_blocks <= self.base_pools[h])
        if len(heads) < len(self.groups):
            self.rearm()  # the groups that cannot restore yet are tried again next round
        return Restore(heads=heads) if heads else None

    def _drop(self, stats: Sequence[InstanceStats | None], alive: Sequence[bool],
              out: set[int]) -> Drop | None:
        groups = [g.members for g in self.groups.values() if not set(g.members) & out]
        plan = None
        for head_only in (False, True):
            # Algorithm 6 plans for every queued request; when no grouping holds them all, it
            # falls back to KV-centric handling and autoscaling (§4.1), which this cluster does
            # not have: then plan for the oldest queued request of each unit (what the drop
            # condition found blocked), so memory still grows where it blocks the queue
            plan = plan_drop(self._capacities(stats, alive, out, head_only=head_only),
                             num_layers=self.num_layers, weight_blocks=self.weight_blocks,
                             groups=groups, pool=self.pool)
            if plan is not None:
                self.head_only_plans += head_only
                break
        if plan is None:
            self.refused += 1
            return None
        running = set(groups)
        new = tuple(g for g in plan.merged if g.members not in running)
        return Drop(plan=plan, new_groups=new) if new else None

    def _capacities(self, stats: Sequence[InstanceStats | None], alive: Sequence[bool],
                    out: set[int], *, head_only: bool) -> list[InstanceCapacity]:
        bs = self.block_size
        caps = []
        for i, st in enumerate(stats):
            if not alive[i] or st is None or i in out:
                continue
            member = self.member_of(i) is not None
            # a head's blocks live in its group's pool: the planner adds the members' pools
            # and the freed weights back, so its free blocks come out as the head's
            used = 0 if member else st.total_blocks - st.free_blocks
            # the running requests' prompts still to come need their KV as much as the queue
            queued = (st.head_tokens if head_only else st.queued_tokens) + st.pending_tokens
            caps.append(InstanceCapacity(
                index=i, pool_blocks=self.base_pools[i], used_blocks=used,
                queued_blocks=0 if member else -(-queued // bs)))
        return caps

    def formed(self, group: GroupPlan) -> None:
        for head in [h for h, g in self.groups.items() if set(g.members) & set(group.members)]:
            del self.groups[head]
        self.groups[group.head] = group
        for m in group.members[1:]:
            self._triggers.pop(m, None)  # a member is evaluated again once it serves alone
        self.rearm()

    def restored(self, head: int) -> None:
        self.groups.pop(head, None)
