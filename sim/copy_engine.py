"""A modelled copy engine for swaps: what a transfer costs and when it finishes.

Pure mechanism, no I/O: the sim swap pool asks `submit` when a transfer issued now would end and
then sleeps until then. A GPU has a copy engine per direction that runs beside compute, so
transfers queue behind earlier ones in the same direction only; swap-outs and swap-ins overlap
each other and the model's steps. A transfer costs `calls * dispatch + bytes / bandwidth`
(FastSwitch §2, Challenge #1: per-call dispatch dominates 128 KB per-block copies).
"""

from __future__ import annotations

import attrs

from engine.iteration_log import SwapCounters
from engine.messages import SwapDirection as Direction
from sim.profile import CopyLink


@attrs.frozen(kw_only=True)
class Transfer:
    """One submitted transfer, in engine-clock seconds."""

    direction: Direction
    calls: int
    nbytes: int
    start: float
    end: float


class CopyEngine:
    def __init__(self, link: CopyLink) -> None:
        self.link = link
        self._free_at: dict[Direction, float] = {"out": 0.0, "in": 0.0}
        self.counters = SwapCounters()

    def busy_until(self, direction: Direction) -> float:
        return self._free_at[direction]

    def submit(self, now: float, direction: Direction, calls: int, nbytes: int) -> Transfer:
        """Queue a transfer of `nbytes` in `calls` copy calls; returns when it runs."""
        if calls < 0 or nbytes < 0:
            raise ValueError(f"a transfer needs calls >= 0 and nbytes >= 0, got {calls}, {nbytes}")
        start = max(now, self._free_at[direction])
        end = start + self.link.copy_s(calls, nbytes)
        self._free_at[direction] = end
        c = self.counters
        c.copy_ops += calls
        if direction == "out":
            c.bytes_out += nbytes
        else:
            c.bytes_in += nbytes
            c.copy_ops_in += calls
        return Transfer(direction=direction, calls=calls, nbytes=nbytes, start=start, end=end)

    def stall(self, now: float, ready_at: float) -> float:
        """A step that needs data arriving at `ready_at` waits this long; counted as stall."""
        wait = max(0.0, ready_at - now)
        self.counters.stall_s += wait
        return wait
