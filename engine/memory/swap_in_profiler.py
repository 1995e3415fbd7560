"""Adaptive swap-in (FastSwitch §3.2): each iteration, swap in synchronously or asynchronously?

A synchronous swap-in stalls the step until the KV is back, but the requests swapped in compute
in that very step; an asynchronous one overlaps the copy with inference and the requests join a
later step: the one after the iteration in which their copy lands, so each loses an iteration or
more. FastSwitch's profiler watches "the number and size" of recent swaps and goes synchronous
"when the total number of requests is high, but each request is relatively short". Here: the
swap-ins that could happen now are the swapped requests among the first `max_num_seqs` of the
order, in order, while their blocks fit in the free blocks (the old rule counted every swapped
request in that head, so with many swapped requests it always went asynchronous); their copy time
is predicted from a running mean of the time a block took to swap in (reported by the swap pool,
per block of a batch's makespan), and a stall of at most `SYNC_SWAP_IN_SHARE` of the last
iteration goes synchronous.

Which one wins, measured on the simulator, is tested in tests/sim/test_adaptive_swap_in.py (many
short requests swapped every few iterations: synchronous; a few long ones over a slow link:
asynchronous; adaptive must pick each).

Pure mechanism: it is told the mode, the order, the free blocks and the last iteration's length;
it answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from engine.iteration_log import SwapCounters
from engine.messages import SwapIn
from engine.policy import RequestView

SwapInMode = Literal["sync", "async", "adaptive"]

SYNC_SWAP_IN_SHARE = 0.5
"""Swap in synchronously when the predicted stall is at most this share of the last iteration:
an asynchronous swap-in costs its request at least one iteration (see above)."""

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
                     max_num_seqs: int, iteration_ms: float,
                     free_blocks: int | None = None) -> bool:
        """Swap in asynchronously this iteration? False when nothing in `order` is swapped;
        `sync` and `async` say; `adaptive` as the module's docstring says, asynchronous when it
        cannot predict yet."""
        if mode == "sync" or not any(r.state == "swapped" for r in order):
            return False  # sync first: the scan is a pass over the whole queue
        if mode != "adaptive":
            return mode == "async"
        if self.seconds_per_block is None or not iteration_ms:
            return True
        head = order[:max_num_seqs]
        coming = self.coming_back(head, free_blocks)
        if not coming:
            return True
        stall_s = self.seconds_per_block * sum(r.swapped_blocks for r in coming)
        return stall_s > SYNC_SWAP_IN_SHARE * iteration_ms / 1000.0

    @staticmethod
    def coming_back(head: Sequence[RequestView], free_blocks: int | None) -> list[RequestView]:
        """The swapped requests of `head`, in order, while their blocks fit in `free_blocks`
        (at least the first: it may evict others to come back)."""
        out: list[RequestView] = []
        room = free_blocks
        for r in head:
            if r.state != "swapped":
                continue
            if room is not None and out and r.swapped_blocks > room:
                break
            out.append(r)
            if room is not None:
                room -= r.swapped_blocks
        return out

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
