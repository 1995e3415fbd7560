"""The simulator's swapper: the interface of `gpu.swap.TorchSwapper` over a modelled copy engine.

No bytes move. A ticket's copies take `calls * dispatch + bytes / bandwidth` (sim/
copy_engine.py) and start once the copy engine is free in their direction and every earlier
ticket sharing a block with them has ended. A step that writes a block a ticket still uses, or
that waits for a synchronous swap-in, starts when those tickets end: that wait is the stall.

Modelled copies succeed unless a test injects a failure (`fail_transfers`): such a ticket ends
as modelled, is reported by `take_failures` as the torch swapper reports one whose copy raised,
and a step that waits for it fails (sim/runner.py), as `TorchSwapper.wait` makes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import anyio
import attrs

from engine.iteration_log import SwapCounters
from engine.memory.block_groups import coalesce
from engine.memory.slot_runs import moves_onto_sources, slot_blocks, slot_runs
from sim.copy_costs import GATHER_CALLS
from sim.copy_engine import CopyEngine
from sim.profile import CopyLink

YIELD_EVERY = 256
"""Copies dispatched between synchronisations (bounded dispatch, FastSwitch §3.2): the default
of the torch backend's swapper (`gpu.swap.TorchSwapper`)."""
YIELD_MS = 2.0
"""... or this much copy time: one copy of a large block group is a single call in our
block-major layout, so a bound by count alone would let one 400 MB copy hold the copy engine;
the swapper issues such a copy in pieces of this length (at the link's bandwidth), each a
dispatch. Our choice (the paper gives no number): a small share of a 30-50 ms A10 iteration."""


class SimSwapper:
    def __init__(self, link: CopyLink, *, block_nbytes: int, num_layers: int,
                 yield_every: int | None = YIELD_EVERY, block_size: int = 16,
                 yield_ms: float | None = YIELD_MS, track_busy: bool = False,
                 start_lag_s: float = 0.0, pickup_s: float = 0.0,
                 slot_gather_calls: float | None = GATHER_CALLS) -> None:
        yield_bytes = None if yield_ms is None else int(
            link.bandwidth_gb_per_s * 1e9 * yield_ms / 1000.0)
        self.engine = CopyEngine(link, yield_every=yield_every, yield_bytes=yield_bytes,
                                 track_busy=track_busy)
        self.block_nbytes = block_nbytes
        self.block_size = block_size
        self.start_lag_s = start_lag_s
        """A transfer's copies start no sooner than this after it is submitted (the engine's
        hop from the plan to its copier: `EngineCost.copy_start_ms`)."""
        self.pickup_s = pickup_s
        """A transfer that finds the copier with nothing to do starts no sooner than this after
        it could (its worker's wake-up: `EngineCost.copy_pickup_ms`); so do the transfers
        submitted before that wake-up."""
        self._quiet_at = 0.0  # when every transfer submitted so far has ended
        self._wake_at = 0.0  # when the copier's last wake-up ends
        self.num_layers = num_layers
        self.transfers = 0
        """Transfers submitted so far (the runner charges the engine's dispatch of each)."""
        self._end: dict[int, float] = {}
        self._device_busy: dict[int, float] = {}
        self._host_busy: dict[int, float] = {}
        self.slots: dict[str, int] = {}
        """Slots moved by slot copies, per direction (BROS's checkpoints and restores)."""
        self._overlapped: set[int] = set()
        self._slot_busy: dict[int, float] = {}
        """Device blocks in slot copies, which overlap the step instead of preceding it."""
        self.slot_gather_calls = slot_gather_calls
        """What one gather of slot copies costs beside its bytes, in copy calls
        (sim/copy_costs.py `GATHER_CALLS`); None: the copier copies run by run, no gather."""
        self.gathers = 0
        """Gathers charged so far (each one call of `copy_ops`)."""
        self.fail_transfers: frozenset[int] = frozenset()
        """Transfers (counted from 1, as `transfers`) whose copies fail with `failure`: fault
        injection for tests (tests/sim/test_chaos_bros_faults_sim.py); none by default."""
        self.failure = "OSError: injected copy failure"
        self._failing: dict[int, str] = {}
        """Tickets that fail, until their end is polled."""
        self._failures: dict[int, str] = {}
        """Failed tickets polled since the last `take_failures`."""
        self._failed: dict[int, str] = {}
        """Every failed ticket and its error (a step may wait for one already polled)."""

    def submit(self, ticket_id: int, direction: str, pairs: Sequence[tuple[int, int]],
               granularity: str) -> None:
        self.transfers += 1
        if self.transfers in self.fail_transfers:
            self._failing[ticket_id] = self._failed[ticket_id] = self.failure
        if granularity == "slots":
            self._submit_slots(ticket_id, direction, pairs)
            return
        now = self._earliest()
        after = max([self._device_busy.get(g, 0.0) for g, _ in pairs]
                    + [self._slot_busy.get(g, 0.0) for g, _ in pairs]
                    + [self._host_busy.get(c, 0.0) for _, c in pairs] + [now])
        runs = len(coalesce(pairs))
        calls = len(pairs) * 2 * self.num_layers if granularity == "per-block" else runs
        t = self.engine.submit(after, direction, calls, len(pairs) * self.block_nbytes)  # type: ignore[arg-type]
        c = self.engine.counters
        c.runs += runs
        if direction == "out":
            c.blocks_out += len(pairs)
        else:
            c.blocks_in += len(pairs)
        self._end[ticket_id] = t.end
        self._quiet_at = max(self._quiet_at, t.end)
        for g, h in pairs:
            self._device_busy[g] = max(self._device_busy.get(g, 0.0), t.end)
            self._host_busy[h] = max(self._host_busy.get(h, 0.0), t.end)

    def _submit_slots(self, ticket_id: int, direction: str,
                      pairs: Sequence[tuple[int, int]]) -> None:
        """BROS's slot copies (gpu/slot_copy.py): one call per block group and one gather for
        the other runs (or one strided call per run: `slot_gather_calls` None),
        `slots * block_nbytes / block_size` bytes. A device -> device move is charged on the
        swap-in engine at the host link's cost (an over-estimate: it never leaves the GPU)."""
        bs = self.block_size
        devices, hosts = slot_blocks(direction, pairs, bs)
        after = max([self._device_busy.get(g, 0.0) for g in devices]
                    + [self._slot_busy.get(g, 0.0) for g in devices]
                    + [self._host_busy.get(h, 0.0) for h in hosts]
                    + [self._earliest()])
        runs = slot_runs(pairs, bs)
        calls, extra_s = self._slot_calls(direction, pairs, runs)
        engine = "out" if direction == "out" else "in"
        t = self.engine.submit(after, engine, calls, len(pairs) * self.block_nbytes // bs,
                               extra_s=extra_s)
        self.engine.counters.runs += len(runs)
        self.slots[direction] = self.slots.get(direction, 0) + len(pairs)
        self._end[ticket_id] = t.end
        self._quiet_at = max(self._quiet_at, t.end)
        self._overlapped.add(ticket_id)
        for g in devices:
            self._slot_busy[g] = max(self._slot_busy.get(g, 0.0), t.end)
        for h in hosts:
            self._host_busy[h] = max(self._host_busy.get(h, 0.0), t.end)

    def _slot_calls(self, direction: str, pairs: Sequence[tuple[int, int]],
                    runs: list[tuple[int, int, int]]) -> tuple[int, float]:
        """(calls, extra seconds) of slot copies as gpu/slot_copy.py makes them: a block group
        (a run longer than a block) is one call; the other runs one call each, or with a gather
        one call together, which costs `slot_gather_calls` calls' dispatch (its bytes are
        charged like any other)."""
        if self.slot_gather_calls is None or moves_onto_sources(direction, pairs):
            return len(runs), 0.0
        groups = sum(1 for _, _, n in runs if n > self.block_size)
        scattered = len(runs) - groups
        if scattered < 2:
            return len(runs), 0.0
        self.gathers += 1
        dispatch_s = self.engine.link.dispatch_us * 1e-6
        return groups + 1, (self.slot_gather_calls - 1.0) * dispatch_s

    def _earliest(self) -> float:
        """When a transfer submitted now may start copying: after the engine's hop to the
        copier, and after the copier's wake-up when it had nothing to do."""
        now = anyio.current_time() + self.start_lag_s
        if self.pickup_s and now >= self._quiet_at:
            self._wake_at = now + self.pickup_s
        return max(now, self._wake_at)

    def poll(self) -> list[int]:
        now = anyio.current_time()
        done = [tid for tid, end in self._end.items() if end <= now]
        for tid in done:
            del self._end[tid]
            self._overlapped.discard(tid)
            if tid in self._failing:
                self._failures[tid] = self._failing.pop(tid)
        if not self._end:  # nothing in flight: no block is busy any more
            self._device_busy.clear()
            self._host_busy.clear()
            self._slot_busy.clear()
        return done

    def take_failures(self) -> dict[int, str]:
        """Tickets whose copies failed (`fail_transfers`), polled since the last call."""
        failures, self._failures = self._failures, {}
        return failures

    def failed(self, tickets: Iterable[int]) -> tuple[int, str, float] | None:
        """The first of `tickets` whose copies fail (`TorchSwapper.wait` raises for it once
        its copy has raised): (ticket, error, when its copies end); None when none does."""
        now = anyio.current_time()
        return next(((t, self._failed[t], self._end.get(t, now)) for t in tickets
                     if t in self._failed), None)

    def next_poll_s(self) -> float | None:
        if not self._end:
            return None
        return max(0.0, min(self._end.values()) - anyio.current_time())

    def blocks_busy(self) -> bool:
        """Some device block is still being copied (else the blocks a step writes cannot make
        it wait, and need not be listed)."""
        return bool(self._device_busy or self._slot_busy)

    def ready_at(self, tickets: Iterable[int], written_blocks: Iterable[int]) -> float:
        """When a step that waits for `tickets` and writes `written_blocks` may start."""
        return max([self._end.get(t, 0.0) for t in tickets if t not in self._overlapped]
                   + [self._device_busy.get(g, 0.0) for g in written_blocks] + [0.0])

    def overlapped_until(self, tickets: Iterable[int], written_blocks: Iterable[int]) -> float:
        """When the slot copies a step depends on end: BROS's checkpoints and swap-backs run
        on their own stream beside the model (§5.2: "consolidated and conducted
        asynchronously"), so the step lasts max(model, copies) (§4.1) rather than their sum."""
        return max([self._end[t] for t in tickets if t in self._overlapped]
                   + [self._slot_busy.get(g, 0.0) for g in written_blocks] + [0.0])

    def add_stall(self, seconds: float) -> None:
        self.engine.counters.stall_s += seconds

    def counters(self) -> SwapCounters:
        return attrs.evolve(self.engine.counters)

    def close(self) -> None:
        pass
