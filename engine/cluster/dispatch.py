"""Dispatch: which instance a new request goes to. The rules are pure functions of frozen views
of the instances (`InstanceView`), named by the policy's `dispatch` statement; `DispatchTable`
is the coordinator's mechanism: what it knows of each instance, from the monitor's reports and
from its own count of requests sent and ended (fresh between two reports)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import attrs


class InstanceView(NamedTuple):
    """One instance as a dispatch rule sees it when a request arrives."""

    index: int
    alive: bool
    in_flight: int
    """Requests dispatched to it and not yet ended (the coordinator's own count)."""
    waiting: int
    running: int
    free_blocks: int
    """Free KV blocks at its last report, less the blocks of requests dispatched since."""
    total_blocks: int
    queued_tokens: int
    """Tokens of demand in flight: prompt + max_tokens of its requests not yet ended."""
    queued_blocks: int = 0
    """KV blocks its queued requests needed at its last report."""
    sent_since_report: int = 0
    """Requests dispatched to it since its last report."""


DispatchRule = Callable[[Sequence[InstanceView], int], int]
"""(views of the live instances (at least one), dispatches so far) -> the chosen one's index."""


def round_robin(live: Sequence[InstanceView], turn: int) -> int:
    return live[turn % len(live)].index


def least_load(live: Sequence[InstanceView], turn: int) -> int:
    """Fewest requests in flight, then least queued demand, then the lowest index."""
    return min(live, key=lambda v: (v.in_flight, v.queued_tokens, v.index)).index


def most_free_kv(live: Sequence[InstanceView], turn: int) -> int:
    """Most free KV blocks (as a share of the instance's pool), then fewest in flight."""
    return max(live, key=lambda v: (v.free_blocks / max(1, v.total_blocks), -v.in_flight,
                                    -v.index)).index


def freeness(live: Sequence[InstanceView], turn: int) -> int:
    """Llumnix's freeness (Sun et al., OSDI '24, §4.4: F = (M - sum of virtual usages) / B;
    its code: AlibabaPAI/llumnix llumnix/load_computation.py `RemainingStepsLoad`, dispatch to
    the most remaining steps): the KV blocks left once the queued requests have theirs, over
    the batch (running + queued + sent since the report), about how many decode steps the
    batch can run before memory runs out. KunServe's dispatcher is Llumnix's (§3). Highest
    wins (it may be negative); an instance with no requests is infinitely free; then fewest
    in flight, then the lowest index."""
    def free(v: InstanceView) -> float:
        batch = v.running + v.waiting + v.sent_since_report
        return (v.free_blocks - v.queued_blocks) / batch if batch else math.inf

    return max(live, key=lambda v: (free(v), -v.in_flight, -v.index)).index


DISPATCH_RULES: dict[str, DispatchRule] = {
    "round_robin": round_robin, "least_load": least_load, "most_free_kv": most_free_kv,
    "freeness": freeness}
"""The rules a policy's `dispatch` statement may name."""


@attrs.frozen(kw_only=True)
class InstanceStats:
    """What the monitor reads from one instance (its engine's snapshot, summarised)."""

    waiting: int
    running: int
    swapped: int
    free_blocks: int
    total_blocks: int
    preemptions: int = 0
    iteration_ms: float = 0.0
    queued_tokens: int = 0
    """KV tokens its queued requests need (KunServe's queued demand, §4.1)."""
    head_tokens: int = 0
    """KV tokens its oldest queued request needs (memory blocks admission when they exceed the
    free KV)."""
    pending_tokens: int = 0
    """KV tokens its running requests still need for their prompts (the running demand)."""

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0


@attrs.define
class _Instance:
    alive: bool = True
    failure: str | None = None
    stats: InstanceStats | None = None
    in_flight: int = 0
    queued_tokens: int = 0
    blocks_since_report: int = 0
    sent_since_report: int = 0
    dispatched: int = 0


class NoInstanceError(Exception):
    """Every instance is down."""


class DispatchTable:
    """The coordinator's view of its instances. Plain and synchronous: no I/O, no clock."""

    def __init__(self, count: int, block_size: int) -> None:
        self._instances = [_Instance() for _ in range(count)]
        self._block_size = block_size
        self.dispatches = 0
        self.redirect: dict[int, int] = {}
        """KunServe: a grouped member -> its head; a member is never chosen while grouped, nor
        from the monitor round that plans its group on (actors/coordinator.py `_forming`)."""

    def views(self) -> list[InstanceView]:
        out = []
        for i, s in enumerate(self._instances):
            st = s.stats
            free = (st.free_blocks if st else 0) - s.blocks_since_report
            out.append(InstanceView(
                index=i, alive=s.alive, in_flight=s.in_flight,
                waiting=st.waiting if st else 0, running=st.running if st else 0,
                free_blocks=max(0, free), total_blocks=st.total_blocks if st else 0,
                queued_tokens=s.queued_tokens,
                queued_blocks=-(-st.queued_tokens // self._block_size) if st else 0,
                sent_since_report=s.sent_since_report))
        return out

    def choose(self, rule: DispatchRule) -> int:
        live = [v for v in self.views() if v.alive and v.index not in self.redirect]
        if not live:
            reasons = "; ".join(f"instance {i}: {s.failure}" for i, s in enumerate(self._instances))
            raise NoInstanceError(f"every instance of the cluster is down ({reasons})")
        return rule(live, self.dispatches)

    def dispatched(self, index: int, demand_tokens: int) -> None:
        s = self._instances[index]
        s.in_flight += 1
        s.dispatched += 1
        s.queued_tokens += demand_tokens
        s.blocks_since_report += -(-demand_tokens // self._block_size)
        s.sent_since_report += 1
        self.dispatches += 1

    def ended(self, index: int, demand_tokens: int) -> None:
        s = self._instances[index]
        s.in_flight -= 1
        s.queued_tokens -= demand_tokens

    def report(self, index: int, stats: InstanceStats) -> None:
        s = self._instances[index]
        s.stats = stats
        s.blocks_since_report = s.sent_since_report = 0

    def down(self, index: int, reason: str) -> None:
        s = self._instances[index]
        s.alive, s.failure = False, reason

    def failure(self, index: int) -> str | None:
        return self._instances[index].failure

    def stats(self, index: int) -> InstanceStats | None:
        return self._instances[index].stats

    def dispatched_to(self, index: int) -> int:
        return self._instances[index].dispatched
