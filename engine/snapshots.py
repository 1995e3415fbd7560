"""Snapshots the actors answer `Inspect*` messages with (tests, the REPL, `/metrics`)."""

from __future__ import annotations

import attrs

from engine.iteration_log import PrefixCacheCounters, SwapCounters


@attrs.frozen(kw_only=True)
class SchedulerSnapshot:
    iteration: int
    policy: str
    policy_version: int = 1
    """1 for the policy the engine started with, +1 for each replacement (rollbacks included)."""
    waiting: int
    running: int
    swapped: int
    swapping_in: int
    free_blocks: int
    total_blocks: int
    live_requests: tuple[int, ...]
    preemptions: int
    iteration_ms: float
    overload: str | None = None
    """The overload trigger firing now (`drop`, `restore`) or None (KunServe §4.1, §4.4)."""
    overload_drops: int = 0
    """How often the policy's drop trigger started firing."""
    overload_restores: int = 0
    """How often its restore trigger started firing."""
    queued_tokens: int = 0
    """KV tokens the requests not running need (prompt and output so far): the queued demand
    KunServe's global monitor reads (§4.1)."""
    head_tokens: int = 0
    """KV tokens the oldest queued request needs: when they exceed the free KV, admission is
    blocked by memory, not by the step's token budget (head-of-line demand, §2.2)."""
    pending_tokens: int = 0
    """KV tokens the running requests still need for their prompts (KV is reserved chunk by
    chunk, so a prompt admitted into less free KV than its rest is preempted mid-prefill): the
    running demand KunServe's monitor adds to the head-of-line demand (§4.1)."""
    cpu_free_blocks: int = 0
    cpu_total_blocks: int = 0
    cpu_copies: int = 0
    """CPU KV copies held: swapped-out requests, backups, and ended turns kept for reuse."""
    cpu_kept_blocks: int = 0
    """Of the host blocks in use, those holding conversations' ended turns kept for reuse: once
    idle, every other host block is free (the soak's leak check)."""
    prefix_cache: PrefixCacheCounters | None = None
    cost_correction: tuple[float, float] | None = None
    """(decode, prefill): the factors the online correction multiplies the cost model's
    predictions by now (engine/cost_model_correction.py); None with it off (the simulator)."""
    cancelled_by_state: tuple[tuple[str, int], ...] = ()
    """Requests cancelled (by their client or a deadline) since the engine started, by the
    state they were in: waiting, running, swapped, swapping_in."""
    """Device prefix cache lookups, hits and evictions since the engine started."""


@attrs.frozen(kw_only=True)
class AllocatorSnapshot:
    free_blocks: int
    allocated_blocks: int
    total_blocks: int
    tables: dict[int, list[int]]
    cached_blocks: int = 0
    """Blocks the prefix cache holds by key, whether a request holds them or they are idle
    (idle ones count as free: they are evicted the moment a block is needed)."""


@attrs.frozen(kw_only=True)
class EngineSnapshot:
    scheduler: SchedulerSnapshot
    allocator: AllocatorSnapshot
    swap: SwapCounters | None = None
    """Swap traffic since the engine started; None for an engine that cannot swap."""

    @property
    def idle(self) -> bool:
        return not self.scheduler.live_requests and self.allocator.allocated_blocks == 0
