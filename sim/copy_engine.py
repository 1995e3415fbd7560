"""A modelled copy engine for swaps: what a transfer costs and when it finishes.

Pure mechanism, no I/O: the sim swap pool asks `submit` when a transfer issued now would end and
then sleeps until then. A GPU has a copy engine per direction that runs beside compute, so
transfers queue behind earlier ones in the same direction only; swap-outs and swap-ins overlap
each other and the model's steps. A transfer costs `calls * dispatch + bytes / bandwidth`
(FastSwitch §2, Challenge #1: per-call dispatch dominates 128 KB per-block copies).

Bounded dispatch (FastSwitch §3.2): the inference stream issues small copies of its own (a
step's inputs in, its sampled tokens out) on the same copy engine, which runs copies in the order
they were dispatched, so without a bound a step's copy waits behind every swap copy dispatched
before it. With `yield_every` set, the swapper synchronises after that many dispatched copies, so
a step's copy slips in at the next such boundary; each synchronisation costs one more dispatch
(the copy engine idles while the next copy is issued). `step_copy` answers when a step's copy
issued now can run and counts the wait.
"""

from __future__ import annotations

import math

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
    def __init__(self, link: CopyLink, *, yield_every: int | None = None,
                 yield_bytes: int | None = None, track_busy: bool = False) -> None:
        if yield_every is not None and yield_every < 1:
            raise ValueError(f"yield_every must be >= 1 or None, got {yield_every}")
        self.link = link
        self.yield_every = yield_every
        """Synchronise after this many dispatched copies (None: no bound by count)."""
        self.yield_bytes = yield_bytes
        """... or after this many bytes (None: no bound by size)."""
        self._free_at: dict[Direction, float] = {"out": 0.0, "in": 0.0}
        self._boundaries: dict[Direction, list[float]] = {"out": [], "in": []}
        """Times at which a synchronisation lets other copies in, per direction (pending ones)."""
        self.counters = SwapCounters()
        self._spans: list[tuple[float, float]] | None = [] if track_busy else None
        """(start, end) of transfers not yet behind every `busy_s` window, when tracked."""

    def busy_until(self, direction: Direction) -> float:
        return self._free_at[direction]

    def submit(self, now: float, direction: Direction, calls: int, nbytes: int, *,
               extra_s: float = 0.0) -> Transfer:
        """Queue a transfer of `nbytes` in `calls` copy calls, plus `extra_s` of fixed cost (a
        gather's dispatches beyond its one call: sim/swap.py); returns when it runs."""
        if calls < 0 or nbytes < 0:
            raise ValueError(f"a transfer needs calls >= 0 and nbytes >= 0, got {calls}, {nbytes}")
        if extra_s < 0:
            raise ValueError(f"a transfer needs extra_s >= 0, got {extra_s}")
        start = max(now, self._free_at[direction])
        end = start + self.link.copy_s(calls, nbytes)
        if (self.yield_every is not None or self.yield_bytes is not None) and calls:
            end = self._bounded(direction, start, calls, nbytes)
        end += extra_s
        self._free_at[direction] = end
        if self._spans is not None and end > start:
            self._spans.append((start, end))
        c = self.counters
        c.copy_ops += calls
        if direction == "out":
            c.bytes_out += nbytes
        else:
            c.bytes_in += nbytes
            c.copy_ops_in += calls
        return Transfer(direction=direction, calls=calls, nbytes=nbytes, start=start, end=end)

    def _bounded(self, direction: Direction, start: float, calls: int, nbytes: int) -> float:
        """Lay the transfer out in runs that end at a synchronisation; returns its end. A run is
        `yield_every` calls or `yield_bytes` bytes, whichever comes first; a call larger than
        `yield_bytes` (a big block group: one copy in our block-major layout) is issued in
        pieces of that size, each costing a dispatch."""
        link = self.link
        size = nbytes / calls
        pieces = 1 if self.yield_bytes is None else max(1, math.ceil(size / self.yield_bytes))
        piece_s = link.dispatch_us * 1e-6 + size / pieces / (link.bandwidth_gb_per_s * 1e9)
        per_run = self.yield_every or calls
        if pieces > 1:
            per_run = 1
        elif self.yield_bytes is not None:
            per_run = min(per_run, max(1, int(self.yield_bytes // max(size, 1.0))))
        total = calls * pieces
        marks = self._boundaries[direction]
        t, done = start, 0
        while done < total:
            k = min(per_run, total - done)
            t += k * piece_s
            done += k
            if k == per_run:  # a full run: synchronise, then issue the next copy afresh
                marks.append(t)
                self.counters.yields += 1
                if done < total:
                    t += link.dispatch_us * 1e-6
        if pieces > 1:  # the extra pieces were extra calls
            self.counters.copy_ops += total - calls
        return t

    def busy_s(self, t0: float, t1: float) -> float:
        """Seconds of copying (both directions added: they run at once) inside [t0, t1]
        (`track_busy`; windows must not start before an earlier window's start)."""
        spans = self._spans
        if not spans or t1 <= t0:
            return 0.0
        spans[:] = [sp for sp in spans if sp[1] > t0]
        return sum(min(e, t1) - max(b, t0) for b, e in spans if b < t1)

    def step_copy(self, now: float, direction: Direction) -> float:
        """When a step's own copy issued at `now` in `direction` can run: after every swap copy
        dispatched so far, or with bounded dispatch at the next synchronisation. Counts the
        wait in `step_copy_wait_s`."""
        ready = self._free_at[direction]
        if ready > now and (self.yield_every is not None or self.yield_bytes is not None):
            marks = self._boundaries[direction]
            while marks and marks[0] < now:
                marks.pop(0)
            if marks:
                ready = min(ready, marks[0])
        wait = max(0.0, ready - now)
        self.counters.step_copy_wait_s += wait
        return wait

    def stall(self, now: float, ready_at: float) -> float:
        """A step that needs data arriving at `ready_at` waits this long; counted as stall."""
        wait = max(0.0, ready_at - now)
        self.counters.stall_s += wait
        return wait
