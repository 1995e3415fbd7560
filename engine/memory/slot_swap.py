"""Whole requests out of BROS's bidirectional table and back (§5.2's extreme case: "we
progressively drop requests: first BE, then RT, based on the remaining time, and swap out their
cache blocks"), for `BidirectionalBlocks` (engine/memory/bidirectional.py); the caller picks whom.

Two host layouts, chosen when the table is made:
- without a copy space (a `preempt recompute` policy; only the table's own extreme case swaps,
  engine/bidirectional_step.py `_make_room`): every position to a host slot of the checkpoint
  space, one by one;
- with a copy space (`copy_blocks`: host blocks the engine sets aside when the policy preempts
  by swap): logical block j of the request goes to a host block of its own, at the device
  block's offsets. A block the request holds alone (the other side has no owner and no slot was
  overwritten) is copied whole; whole blocks consecutive on the device and on the host are one
  copy (engine/memory/slot_runs.py), FastSwitch's block groups: the host blocks are taken as a
  few runs and matched to the device blocks in block order. A block shared with another owner is
  copied slot-masked: exactly the request's live slots, so the other owner's are never read
  over or written. Slots already checkpointed stay where they are.
  Swap-in takes free blocks, as few runs as the free list allows, and copies back exactly what
  went out (whole blocks whole, masked ones slot by slot), then the checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.memory.block_groups import FreeRuns
from engine.memory.host_slots import HostSlots
from engine.memory.slot_owners import BidirectionalError, Block, Seq
from engine.memory.slot_runs import SlotCopies, decode, encode, physical_slot


class HostBlocks:
    """The copy space: host block ids handed out as few contiguous runs as possible."""

    def __init__(self, ids: range) -> None:
        self._runs = FreeRuns()
        self._runs.add(ids.start, len(ids))
        self.num_total = self.num_free = len(ids)

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            got = self._runs.take(n - len(out))
            assert got is not None, "take more host blocks than are free"
            out.extend(range(got[0], got[0] + got[1]))
        self.num_free -= n
        return out

    def give(self, blocks: list[int]) -> None:
        for start, n in _runs_of(sorted(blocks)):
            self._runs.add(start, n)
        self.num_free += len(blocks)


def _runs_of(ids: list[int]) -> list[tuple[int, int]]:
    """(start, length) of the runs of consecutive ids in sorted `ids`."""
    runs: list[list[int]] = []
    for b in ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return [(s, n) for s, n in runs]


def take_runs(free: list[int], n: int) -> list[int]:
    """n blocks out of the free list `free` (changed in place), in as few runs of consecutive
    ids as it holds: the shortest run that fits, else the longest runs first. Ascending."""
    runs = _runs_of(sorted(free))
    fit = min((r for r in runs if r[1] >= n), key=lambda r: r[1], default=None)
    picked: list[int] = []
    for start, length in [fit] if fit else sorted(runs, key=lambda r: -r[1]):
        picked.extend(range(start, start + min(length, n - len(picked))))
        if len(picked) == n:
            break
    taken = set(picked)
    free[:] = [b for b in free if b not in taken]
    return sorted(picked)


class SlotSwaps:
    """`swap_out` / `swap_in` of BidirectionalBlocks."""

    block_size: int
    _seqs: dict[int, Seq]
    _blocks: dict[int, Block]
    _free: list[int]
    _free_host: HostSlots
    _copy_space: HostBlocks | None
    copied: set[int]
    _undisplace: Callable[[Seq], None]
    _release_all: Callable[[Seq], None]
    _own: Callable[[int, int, bool], None]

    @property
    def has_copy_space(self) -> bool:
        """Whole requests go out in blocks (the engine set host blocks aside for them)."""
        return self._copy_space is not None

    @property
    def free_copy_blocks(self) -> int:
        return self._copy_space.num_free if self._copy_space is not None else 0

    def can_swap_out(self, rid: int) -> bool:
        s = self._seqs[rid]
        if s.swapped:
            return False
        if self._copy_space is not None:
            return len(s.table) <= self._copy_space.num_free
        return s.tokens - len(s.host) <= len(self._free_host)

    def swap_out(self, rid: int) -> SlotCopies:
        """Copy every live slot of the request to the host and release its blocks; it keeps
        its checkpointed slots, and `swap_in` brings all back."""
        s = self._seqs[rid]
        if not self.can_swap_out(rid):
            raise BidirectionalError(f"request {rid} cannot be swapped out now")
        self._undisplace(s)
        out = self._blocks_out(s) if self._copy_space is not None else self._slots_out(s)
        self._release_all(s)
        s.swapped = True
        self.copied.add(rid)
        return SlotCopies(out=tuple(out))

    def _slots_out(self, s: Seq) -> list[tuple[int, int]]:
        out, host = [], None
        for pos in range(s.tokens):
            if pos not in s.host:
                host = self._free_host.take(host, s.tokens - pos)
                s.host[pos] = host
                out.append((physical_slot(s.table[pos // self.block_size], pos % self.block_size,
                                          self.block_size), host))
        return out

    def _blocks_out(self, s: Seq) -> list[tuple[int, int]]:
        assert self._copy_space is not None
        bs, n = self.block_size, len(s.table)
        order = sorted(range(n), key=lambda j: s.table[j] if s.table[j] >= 0 else -s.table[j] - 1)
        s.copy = [0] * n
        whole: list[tuple[int, int]] = []
        masked: list[tuple[int, int]] = []
        for j, h in zip(order, self._copy_space.take(n)):
            b, rev = decode(s.table[j])
            x = self._blocks[b]
            s.copy[j] = h
            if (x.rt if rev else x.be) < 0 and not x.lost:  # its own: the whole block
                whole += [(b * bs + o, h * bs + o) for o in range(bs)]
                continue
            s.masked.add(j)  # shared: exactly its live slots, at their offsets
            masked += sorted((b * bs + o, h * bs + o) for o in self._live_offsets(s, j))
        return whole + masked

    def _live_offsets(self, s: Seq, j: int) -> list[int]:
        """Offsets in its block of the positions of logical block j the request holds live."""
        bs = self.block_size
        return [physical_slot(s.table[j], pos % bs, bs) % bs
                for pos in range(j * bs, min(s.tokens, (j + 1) * bs)) if pos not in s.host]

    def can_swap_in(self, rid: int) -> bool:
        s = self._seqs[rid]
        if not s.swapped:
            return False
        return -(-s.tokens // self.block_size) <= len(self._free)

    def swap_in(self, rid: int) -> SlotCopies:
        """Bring a swapped-out request back into blocks of its own (free ones)."""
        s = self._seqs[rid]
        if not self.can_swap_in(rid):
            raise BidirectionalError(f"request {rid} cannot be swapped in now")
        bs, n = self.block_size, -(-s.tokens // self.block_size)
        if self._copy_space is not None:
            order = sorted(range(n), key=s.copy.__getitem__)
            s.table = [0] * n
            for j, b in zip(order, take_runs(self._free, n)):
                s.table[j] = encode(b, s.reverse)
        else:
            order = list(range(n))
            s.table = [encode(self._free.pop(), s.reverse) for _ in range(n)]
        into: list[tuple[int, int]] = []
        for j in order:
            b, _ = decode(s.table[j])
            self._own(b, rid, s.reverse)
            fill = min(bs, s.tokens - j * bs)
            if s.reverse:
                self._blocks[b].be_fill = fill
            else:
                self._blocks[b].rt_fill = fill
            if s.copy:
                h = s.copy[j]
                if j not in s.masked:
                    into += [(h * bs + o, b * bs + o) for o in range(bs)]
                    continue
                into += sorted((h * bs + o, b * bs + o) for o in self._live_offsets(s, j))
        # checkpoints (all of it without a copy space), by destination: a block's are one run
        into += sorted(((h, physical_slot(s.table[pos // bs], pos % bs, bs))
                        for pos, h in s.host.items()), key=lambda p: p[1])
        self._free_host.give(s.host.values())
        s.host.clear()
        if s.copy:
            assert self._copy_space is not None
            self._copy_space.give(s.copy)
            s.copy, s.masked = [], set()
        s.swapped = False
        self.copied.add(rid)
        return SlotCopies(into=tuple(into))
