"""A pipeline group's restore, prefetched while it keeps serving (KunServe §4.4: "we overlap
restoring with the normal request processing ... prioritizing the pipeline network over the
parameter transfer").

The dropped layers' weights never change, so every member can write them back into place
before the switch to serving alone. Their place is the memory the stage view (gpu/stage_view.py)
lent to KV blocks, so the member first *vacates* it: every group block id still in the pool
(the engine's pool shrank back to the solo size before this, `GroupPrefetch.pool`) whose stage
block overlaps a dropped range moves its kept layers' KV to a free stage block outside them (a
local copy, counted), ids beyond the pool are unmapped, and the dropped ranges' stage blocks are
never handed out again (gpu/block_map.py `evacuate`). In place rather than in a staging buffer:
the boundary then copies no weight at all (a staging buffer would still cost one copy of every
dropped byte there, and as much memory again), and a pool shrunk back to the solo size always
fits outside the dropped ranges (the old KV blocks alone give every member at least L/k' stage
blocks per solo block). The head also puts every block of its pool home as it vacates (gpu/
block_map.py `home`, `place`: where its solo block's layers lie, a local copy for one elsewhere,
in an order that overwrites nothing still to be read), so the restore's step copies none of its
own kept KV and holds none outside the arena.

Then a thread per source writes the weights: from each member keeping them (every member queues
its kept range on its transfer queue's KV lane, in chunks of `chunk_blocks` arena blocks:
activations go first, §4.2) or from the member's own host copy taken at the drop. Steps run
meanwhile; each step's reply says whether a member's weights are all in (`done`). The KV of
every live request's full blocks goes to the head at the same time (gpu/restore_kv.py). The
restore at the boundary then only waits for what is left (nothing, once every member said so),
switches the view back and moves the KV of the blocks after those.

Faults: a receiving thread that finds a member gone records it (`check` raises it on the next
step: the head recovers from its host copy as for any loss); `stop` ends the threads (after the
channel is closed broken, which ends a receive still posted) before the host copy is written.
Tests' fault point `restore-prefetch` (gpu/data_plane.py `fault_point`): a member killed as
the prefetch reaches it, before it vacates or sends anything. A member that cannot vacate (an
error, not a loss: raised before any block moved) falls back to the restore's step for its own
weights (`from_host`) while still sending its kept layers and taking the others' into scratch,
so no peer's transfer waits on it; its answers say so (gpu/group_member.py `start_prefetch`).
A prefetching thread that fails (not a loss) does the same from there (the head's too): its
peer's chunks still due are taken into scratch. A vacating that fails part-way (its map moved
blocks whose KV did not) breaks the group: `PrefetchBroken` ends it as a loss does, every
member told, every request recomputed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import torch

from gpu.data_plane import WEIGHTS_TAG, GroupMemberLost, fault_point
from gpu.stage_view import (
    StageView,
    dropped_ranges,
    elem_range,
    kept_weight_ranges,
    restore_layers,
)

PREFETCH_FAULT_ENV = "SHUNTER_PREFETCH_FAULT"
"""Tests' faults (errors, not losses), once: `kv@<rank>` a member's first KV round cannot be
gathered (gpu/group_member.py), `vacate@<rank>` it cannot vacate, `copy@<rank>` its vacating
fails after one copy, `fill@<rank>` (the head's too) a prefetched chunk cannot be written."""

PREFETCH_CHUNK_BLOCKS = 16
"""Arena blocks of weights per chunk on the KV lane (one block: every layer's KV of
`block_size` tokens; 64 KiB on the tiny test models, 2 MiB on an 8B fp16 model)."""


@attrs.frozen(kw_only=True)
class GroupPrefetch:
    """The head to every member, between two steps: start writing your dropped layers back
    while the group serves (the restore follows later with `GroupRestore`)."""

    source: str
    """'peer' (from the members keeping them) or 'host' (each one's host copy)."""
    pool: range
    """The group ids the head's pool holds now (shrunk back): their KV must stay."""
    chunk_blocks: int = PREFETCH_CHUNK_BLOCKS
    kv_blocks: Mapping[int, int] = attrs.field(factory=dict)
    """Request -> its first blocks, full: their KV goes to the head now (gpu/restore_kv.py)."""


def kept_blocks(layout, keep: range) -> range:
    return range(layout.layer_blocks[keep.start].start, layout.layer_blocks[keep.stop - 1].stop)


def chunks(blocks: range, per: int) -> list[range]:
    return [range(lo, min(lo + per, blocks.stop)) for lo in range(blocks.start, blocks.stop, per)]


def dropped_mask(view, layout, num_layers: int) -> np.ndarray:
    """Stage blocks of `view` (a StageView) that overlap a layer range it drops (bool per
    block)."""
    L = num_layers
    starts = view.first + np.arange(view.num_blocks, dtype=np.int64) * view.stride * view.unit
    span = len(view.keep) * view.unit
    out = np.zeros(view.num_blocks, dtype=bool)
    for _, blocks in dropped_ranges(layout, L, view.keep):
        lo, hi = blocks.start * L * view.unit, blocks.stop * L * view.unit
        out |= (starts < hi) & (starts + span > lo)
    return out


def room_outside(model, layers: Sequence[range]) -> int:
    """The most group blocks every member (same arena geometry as `model`'s) holds outside
    the memory its dropped layers' weights come back to: a prefetch needs the pool no larger."""
    arena, config = model.arena, model.config
    out = []
    for keep in layers:
        view = StageView(config, arena.block_size, arena.total_blocks,
                         kept_weight_ranges(arena.layout, keep), keep)
        mask = np.zeros(view.num_blocks, dtype=bool)
        mask[view.usable] = True
        out.append(int(np.count_nonzero(mask & ~dropped_mask(view, arena.layout,
                                                             config.num_layers))))
    return min(out)


class WeightPrefetch:
    """One member's dropped layers written back in place while its group serves."""

    def __init__(self, stage, ranks: Sequence[int], layers: Sequence[range],
                 msg: GroupPrefetch) -> None:
        if msg.source not in ("peer", "host"):
            raise ValueError(f"restore source must be 'peer' or 'host', got {msg.source!r}")
        fault_point("restore-prefetch", stage.plane.rank)
        self.stage, self.source = stage, msg.source
        model, arena = stage.model, stage.model.arena
        began = time.perf_counter()
        view, L = model.drop_state.view, model.config.num_layers
        live = set(stage.map.locals({g for s in stage.seqs.values() for g in s.table}))
        self.from_host: str | None = None
        """A member that could not vacate (why): it keeps its KV where it is, takes the
        weights its peers send into scratch, and writes its own back from its host copy at
        the restore's step (the one-step restore's part for it); it still sends its kept
        layers, so every other member's prefetch goes on."""
        try:
            if os.environ.get(PREFETCH_FAULT_ENV) == f"vacate@{stage.plane.rank}":
                del os.environ[PREFETCH_FAULT_ENV]  # (once)
                raise RuntimeError("the test's fault: this member could not vacate")
            if stage.me == 0:  # the head's kept KV goes where its solo blocks' layers lie
                stage.map.home(lambda g: view.local_at(g * L), msg.pool)
            copies = stage.map.evacuate(dropped_mask(view, arena.layout, L), msg.pool)
        except Exception as exc:  # (raised before any block moved)
            if stage.me == 0:  # the head's: refused before anything is sent
                raise
            self.from_host, copies = f"{type(exc).__name__}: {exc}", []
        self.vacated_blocks = len(copies)
        if stage.me == 0:
            copies += stage.map.place(msg.pool)
        try:
            for k, (src, dst) in enumerate(copies):  # (in order: each dst free when it comes)
                if k == 1 and os.environ.get(PREFETCH_FAULT_ENV) == f"copy@{stage.plane.rank}":
                    del os.environ[PREFETCH_FAULT_ENV]  # (once: a device error part-way)
                    raise RuntimeError("the test's fault: a vacating copy failed part-way")
                stage._copy_block(src, dst)
        except Exception as exc:  # its map moved blocks whose KV did not
            raise PrefetchBroken(f"instance {stage.plane.rank} vacating: "
                                 f"{type(exc).__name__}: {exc}") from exc
        self.vacated_live = sum(src in live for src, _ in copies[:self.vacated_blocks])
        """Of them, blocks a live request's table holds (the others: freed ids still in the
        pool, kept for a prefix cache's sake)."""
        self.vacate_s = time.perf_counter() - began
        self.bytes = 0
        """Weight bytes written so far (received or copied from the host)."""
        self.sent_bytes = 0
        self.at_boundary = 0
        """Of `bytes`, those the restore's boundary waited for."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        layout, per = arena.layout, msg.chunk_blocks
        jobs: list[tuple[int | None, list[range]]] = []  # (source rank or None: host, chunks)
        if msg.source == "host":
            for (first, stop) in model.drop_state.host_copy:
                jobs.append((None, chunks(range(first, stop), per)))
        else:
            mine = kept_blocks(layout, stage.keep)
            for k, rank in enumerate(ranks):
                if k == stage.me:
                    continue
                for c in chunks(mine, per):  # views of kept weights: they never change
                    part = arena.buffer[elem_range(arena, c)]
                    stage.plane.queue.put(part, dst=rank, tag=WEIGHTS_TAG, kind="kv")
                    self.sent_bytes += part.numel() * part.element_size()
                jobs.append((rank, chunks(kept_blocks(layout, layers[k]), per)))
        if self.from_host is not None:  # nothing is written in place before the step
            jobs = [(rank, parts) for rank, parts in jobs if rank is not None]
        self._scratch: torch.Tensor | None = None
        self._threads = [threading.Thread(target=self._fill, args=job, daemon=True,
                                          name="shunter-restore-prefetch") for job in jobs]
        for t in self._threads:
            t.start()

    def _fill(self, rank: int | None, parts: list[range]) -> None:
        """One source's chunks into place. An error that is not a loss makes the member fall
        back to its host copy at the restore's step (`from_host`): a peer's chunks still to
        come are taken into scratch (its sends must end: its KV lane goes on behind them)."""
        arena = self.stage.model.arena
        host = self.stage.model.drop_state.host_copy
        try:
            with torch.inference_mode():
                for c in parts:
                    if self._stop.is_set():
                        return
                    posted, n = False, len(c) * arena.layout.block_elems
                    try:
                        self._fault()
                        dst = arena.buffer[elem_range(arena, c)]
                        if self.from_host is not None:  # taken and let go (see `from_host`)
                            dst = self._scratch_of(n)
                        if rank is None:
                            first, saved = _held(host, c)
                            per = arena.layout.block_elems
                            dst.copy_(saved[(c.start - first) * per:(c.stop - first) * per])
                        else:
                            posted = True
                            self.stage.plane.recv_tensor(dst, rank, WEIGHTS_TAG,
                                                         "its layers were being prefetched")
                    except GroupMemberLost:
                        raise
                    except Exception as exc:  # noqa: BLE001 (not a loss: the host copy then)
                        with self._lock:
                            self.from_host = self.from_host or (
                                f"prefetching its layers failed: {type(exc).__name__}: {exc}")
                        if rank is None:
                            return  # (nothing is due from anyone)
                        if not posted:  # (this chunk is still due from the peer: taken too)
                            self.stage.plane.recv_tensor(self._scratch_of(n), rank, WEIGHTS_TAG,
                                                         "its layers were being prefetched")
                        continue
                    with self._lock:
                        self.bytes += 0 if self.from_host else dst.numel() * dst.element_size()
        except BaseException as exc:  # noqa: BLE001 (raised by `check` / `finish`)
            with self._lock:
                self.error = self.error or exc

    def _scratch_of(self, n: int) -> torch.Tensor:
        with self._lock:
            if self._scratch is None or self._scratch.numel() < n:
                arena = self.stage.model.arena
                self._scratch = torch.empty(n, dtype=arena.dtype, device=arena.device)
            return self._scratch[:n]

    def _fault(self) -> None:
        with self._lock:
            if os.environ.get(PREFETCH_FAULT_ENV) == f"fill@{self.stage.plane.rank}":
                del os.environ[PREFETCH_FAULT_ENV]  # (once)
                raise OSError("the test's fault: a prefetched chunk could not be written")

    @property
    def done(self) -> bool:
        return not any(t.is_alive() for t in self._threads) and self.error is None

    def check(self) -> bool:
        """Whether every weight is in; raises what ended a thread (a member lost: its
        `GroupMemberLost`)."""
        if self.error is not None:
            if isinstance(self.error, GroupMemberLost):
                raise self.error
            raise RuntimeError(f"prefetching the dropped layers failed: "
                               f"{type(self.error).__name__}: {self.error}") from self.error
        return self.done

    def finish(self) -> float:
        """At the restore's boundary: wait for what is left. Returns the seconds waited."""
        began = time.perf_counter()
        for t in self._threads:
            t.join()
        self.check()
        return time.perf_counter() - began

    def stop(self) -> None:
        """The group broke: end the threads (call it after the channel was closed broken, which
        ends a receive still posted); the host copy is written afterwards."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30.0)

    def report(self) -> dict:
        return {"source": self.source, "from_host": self.from_host,
                "vacated_blocks": self.vacated_blocks,
                "vacated_live": self.vacated_live,
                "vacate_s": self.vacate_s, "bytes": self.bytes, "sent_bytes": self.sent_bytes}


def _held(host: dict, blocks: range) -> tuple[int, torch.Tensor]:
    for (first, stop), saved in host.items():
        if first <= blocks.start and blocks.stop <= stop:
            return first, saved
    raise KeyError(f"blocks {blocks} are in no host copy of the dropped layers")


class PrefetchBroken(GroupMemberLost):
    """A restore prefetch that failed part-way (an error, not a loss: a member's KV may be half
    moved out of the dropped layers' memory): the group can neither serve on nor restore as it
    stands, so it ends as after a loss (rank -1: no member is gone, every one is told), and
    the engine recomputes every request."""

    def __init__(self, why: str) -> None:
        RuntimeError.__init__(self, f"the group's restore prefetch broke: {why}")
        self.rank = -1


def prefetch_state(stage) -> bool | None:
    """For a step's reply: whether `stage`'s prefetched weights are all in (None: no prefetch
    runs); raises what ended its prefetch (a member lost: `GroupMemberLost`; one that failed
    part-way: `PrefetchBroken`)."""
    if isinstance(failed := stage.prefetch_failed, GroupMemberLost):
        raise failed
    if failed is not None:
        raise PrefetchBroken(f"a member's prefetch failed as it started: "
                             f"{type(failed).__name__}: {failed}")
    prefetch = stage.prefetch
    return None if prefetch is None else prefetch.check()


def stop_prefetch(stage) -> None:
    """Stop `stage`'s prefetch, if one runs (a broken group, its channel closed)."""
    prefetch = stage.prefetch
    if prefetch is not None:
        prefetch.stop()
    kv = stage.kv_prefetch
    if kv is not None:  # (the head's: its receiving threads end with the channel)
        kv.close()


def restore_weights(stage, ranks: Sequence[int], layers: Sequence[range], source: str) -> int:
    """At the boundary: every member's dropped layers back into place, from the members keeping
    them (each sends its kept range, one tensor, to every other) or from its own host copy.
    With a prefetch (`stage.prefetch`): only what it has not written yet, waited for. Returns
    the weight bytes written here at the boundary."""
    model, arena = stage.model, stage.model.arena
    per = arena.layout.block_elems * arena.buffer.element_size()
    dropped = sum(len(b) for _, b in dropped_ranges(arena.layout, model.config.num_layers,
                                                     stage.keep)) * per
    prefetch = stage.prefetch
    if prefetch is not None:  # in place already, or arriving: wait for the rest
        before = prefetch.bytes
        prefetch.finish()
        if prefetch.from_host is not None:  # it could not vacate: all of them from its host
            restore_layers(model)  # copy now (its KV there was read before: the caller)
            prefetch.at_boundary = dropped
            return dropped
        restore_layers(model, lambda blocks, dst: None)
        prefetch.at_boundary = prefetch.bytes - before
        return prefetch.at_boundary
    if source == "host":
        restore_layers(model)
        return dropped
    if source != "peer":
        raise ValueError(f"restore source must be 'peer' or 'host', got {source!r}")
    plane, layout = stage.plane, arena.layout
    mine = arena.buffer[elem_range(arena, kept_blocks(layout, stage.keep))]
    for k, rank in enumerate(ranks):
        if k != stage.me:
            plane.queue.put(mine, dst=rank, tag=WEIGHTS_TAG, kind="kv")

    def fill(blocks: range, dst: torch.Tensor) -> None:
        per = layout.block_elems
        for k, keep in enumerate(layers):
            kb = kept_blocks(layout, keep)
            if k != stage.me and blocks.start <= kb.start and kb.stop <= blocks.stop:
                lo = (kb.start - blocks.start) * per
                plane.recv_tensor(dst[lo:lo + len(kb) * per], ranks[k], WEIGHTS_TAG,
                                  "its layers were being restored")

    restore_layers(model, fill)
    plane.queue.flush()
    return dropped


def prefetch_report(stage) -> dict:
    """A restore's prefetch counters for its stats ({} when it had none)."""
    prefetch = stage.prefetch
    if prefetch is None:
        return {"prefetched": False}
    r = prefetch.report()
    return {"prefetched": True, "from_host": r["from_host"],
            "weight_bytes_before": 0.0 if r["from_host"] else float(
                r["bytes"] - prefetch.at_boundary),
            "vacated_blocks": r["vacated_blocks"], "vacated_live": r["vacated_live"],
            "vacate_s": r["vacate_s"], "placed_blocks": float(stage.map.placed_blocks),
            "aside_blocks": float(stage.map.aside_blocks)}
