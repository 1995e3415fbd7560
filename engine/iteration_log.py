"""What the scheduler did, iteration by iteration: the raw material of `shunter bench`'s
engine-side metrics (scheduler time per iteration, KV usage and queue length over time, swap
volume). Off unless `EngineConfig.record_iterations` is set; O(1) appends per iteration."""

from __future__ import annotations

from array import array

import attrs


@attrs.define(eq=False)
class SwapCounters:
    """Swap traffic between device and host (FastSwitch); zero until swapping exists."""

    copy_ops: int = 0
    """Copy calls issued (one per block per layer for vLLM's layout, one per group for groups)."""
    copy_ops_in: int = 0
    """Of `copy_ops`, those host -> device (swap-ins)."""
    bytes_out: int = 0
    """Device -> host."""
    bytes_in: int = 0
    """Host -> device."""
    stall_s: float = 0.0
    """Iteration time lost waiting for swap-ins to finish."""
    blocks_out: int = 0
    """KV blocks copied device -> host."""
    blocks_in: int = 0
    reused_blocks: int = 0
    """Blocks a swap-out did not copy because a valid CPU copy held them (FastSwitch §3.3)."""
    turn_prefix_blocks: int = 0
    """Blocks of a conversation's earlier turns swapped in instead of prefilled again."""
    sync_swap_ins: int = 0
    """Requests swapped in with the step waiting for them (the rest were asynchronous)."""
    async_swap_ins: int = 0
    turn_end_blocks_out: int = 0
    """Of `blocks_out`, those copied when a conversation's turn ended, to keep its KV for the
    next turn (the rest were copied to preempt)."""
    runs: int = 0
    """Runs of blocks consecutive on both sides among the swapped blocks: the copies a swap
    takes in our block-major layout (FastSwitch §3.1 groups), whatever the granularity ran."""
    yields: int = 0
    """Times the swap copier stopped dispatching to let the copy engine drain (bounded
    dispatch, FastSwitch §3.2), so the inference stream's own copies are not queued behind
    all of ours."""
    step_copy_wait_s: float = 0.0
    """Time the steps' own host <-> device copies (inputs, sampled tokens) waited behind swap
    copies on the copy engine (modelled by the simulator; 0 on the torch backend)."""

    def minus(self, earlier: SwapCounters) -> SwapCounters:
        return SwapCounters(**{f.name: getattr(self, f.name) - getattr(earlier, f.name)
                               for f in attrs.fields(SwapCounters)})

    def plus(self, other: SwapCounters) -> SwapCounters:
        return SwapCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                               for f in attrs.fields(SwapCounters)})


@attrs.define(eq=False)
class PrefixCacheCounters:
    """Prefix cache traffic, counted at each admission of a request holding no KV."""

    queried_tokens: int = 0
    """Context tokens of the requests looked up when admitted."""
    hit_tokens: int = 0
    """Of those, tokens found in the cache (not computed again)."""
    queried_blocks: int = 0
    """Full blocks of those contexts."""
    hit_blocks: int = 0
    evicted_blocks: int = 0
    """Cached blocks evicted to make room."""

    def plus(self, other: PrefixCacheCounters) -> PrefixCacheCounters:
        return PrefixCacheCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                                      for f in attrs.fields(PrefixCacheCounters)})

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = attrs.asdict(self)
        out["token_hit_rate"] = self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
        out["block_hit_rate"] = self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0
        return out


@attrs.define(eq=False)
class IterationLog:
    """One entry per iteration sent to the executor, in parallel arrays."""

    total_blocks: int
    time: array = attrs.field(factory=lambda: array("d"))
    """Engine clock (s) when the iteration was planned."""
    scheduler_s: array = attrs.field(factory=lambda: array("d"))
    """CPU seconds (`time.thread_time`) the scheduler spent planning it, never the simulated
    clock (the simulator may charge them to it: `EngineConfig.charge_scheduler_time`)."""
    batch_seqs: array = attrs.field(factory=lambda: array("l"))
    batch_tokens: array = attrs.field(factory=lambda: array("l"))
    queued: array = attrs.field(factory=lambda: array("l"))
    """Live requests left out of the batch (waiting, preempted or swapped)."""
    used_blocks: array = attrs.field(factory=lambda: array("l"))
    preemptions: int = 0
    swap: SwapCounters = attrs.field(factory=SwapCounters)
    predictions: list[tuple[float, float]] = attrs.field(factory=list)
    """(predicted, measured) ms of iterations the policy had a cost-model prediction for."""
    raw_predictions: array = attrs.field(factory=lambda: array("d"))
    """The base model's own prediction (ms) of each `predictions` entry: its first item unless
    the online correction is on (`EngineConfig.cost_correction`)."""
    prefix: PrefixCacheCounters = attrs.field(factory=PrefixCacheCounters)

    def add(self, *, now: float, scheduler_s: float, batch_seqs: int, batch_tokens: int,
            queued: int, used_blocks: int) -> None:
        self.time.append(now)
        self.scheduler_s.append(scheduler_s)
        self.batch_seqs.append(batch_seqs)
        self.batch_tokens.append(batch_tokens)
        self.queued.append(queued)
        self.used_blocks.append(used_blocks)

    def __len__(self) -> int:
        return len(self.time)

    def kv_usage(self) -> list[float]:
        """Fraction of device KV blocks in use at each iteration."""
        n = self.total_blocks or 1
        return [u / n for u in self.used_blocks]
