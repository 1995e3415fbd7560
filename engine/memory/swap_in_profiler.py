"""Adaptive swap-in (FastSwitch §3.2): each iteration, swap in synchronously or asynchronously?

A synchronous swap-in stalls the step until the KV is back, but the request computes in that
very step; an asynchronous one overlaps the copy with inference and the request joins a later
step. The profiler keeps a running mean of the time one block takes to swap in (reported by the
swap pool) and chooses sync when the swap-ins that could happen now are predicted to cost only a
small share of an iteration: a short stall beats making the request wait an iteration more.

Pure mechanism: it is told the mode, the order and the last iteration's length; it answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from engine.iteration_log import SwapCounters
from engine.messages import SwapIn
from engine.policy import RequestView

SwapInMode = Literal["sync", "async", "adaptive"]

SYNC_SWAP_IN_SHARE = 0.25
"""Swap in synchronously when the predicted swap-in time is at most this share of the last
iteration."""

SWAP_RATE_SMOOTHING = 0.2
"""Weight of the newest measurement in the running mean of seconds per swapped-in block."""


class SwapInProfiler:
    def __init__(self) -> None:
        self.seconds_per_block: float | None = None
        """Running mean of the time one block took to swap in; None before the first report."""
        self.sync_swap_ins = 0
        """Requests swapped in with their step waiting for them, since the last take."""
        self.async_swap_ins = 0

    def observe(self, seconds_per_block: float | None) -> None:
        """A swap-in measurement from the swap pool (None: nothing measured)."""
        if seconds_per_block is None:
            return
        old = self.seconds_per_block
        self.seconds_per_block = seconds_per_block if old is None else (
            (1 - SWAP_RATE_SMOOTHING) * old + SWAP_RATE_SMOOTHING * seconds_per_block)

    def asynchronous(self, mode: SwapInMode, order: Sequence[RequestView], *,
                     max_num_seqs: int, iteration_ms: float) -> bool:
        """Swap in asynchronously this iteration? False when nothing in `order` is swapped;
        `sync` and `async` say; `adaptive` predicts how long the swapped requests among the
        first `max_num_seqs` of the order (those that could come back now) take to swap in,
        and goes asynchronous unless that is a small share of `iteration_ms`, or when it
        cannot be predicted yet."""
        if not any(r.state == "swapped" for r in order):
            return False
        if mode != "adaptive":
            return mode == "async"
        if self.seconds_per_block is None or not iteration_ms:
            return True
        candidates = [r for r in order[:max_num_seqs] if r.state == "swapped"]
        if not candidates:
            return True
        predicted = self.seconds_per_block * sum(r.swapped_blocks for r in candidates)
        return predicted > SYNC_SWAP_IN_SHARE * iteration_ms / 1000.0

    def count(self, swap_ins: Sequence[SwapIn]) -> None:
        """Count the choices a step carries out."""
        for s in swap_ins:
            if s.sync:
                self.sync_swap_ins += 1
            else:
                self.async_swap_ins += 1

    def take_counters(self) -> SwapCounters:
        """`sync_swap_ins` and `async_swap_ins` since the last take; counting starts afresh."""
        taken = SwapCounters(sync_swap_ins=self.sync_swap_ins,
                             async_swap_ins=self.async_swap_ins)
        self.sync_swap_ins = self.async_swap_ins = 0
        return taken
