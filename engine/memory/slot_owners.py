"""The records of BROS's bidirectional block table (engine/memory/bidirectional.py): who owns
each block's two sides and how far each fills it, and each request's signed block table and host
slots; the table's read-only queries (counts and the invariants' slots); and the search for a
guest block (§5.2 FindBlock: a BE request's last block placed in the empty right side of an RT
block)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import attrs

from engine.memory.slot_runs import physical_slot


class BidirectionalError(Exception):
    """The caller asked for something the table cannot do (a bug, not a user error)."""


@attrs.define(slots=True)
class Block:
    rt: int = -1
    rt_fill: int = 0
    be: int = -1
    be_fill: int = 0
    lost: set[int] = attrs.field(factory=set)
    """Physical offsets of BE slots an RT write overwrote (each checkpointed first)."""
    guest: bool = False
    """The BE owner came into the RT owner's block (as a guest; counted, not decided on)."""


@attrs.define(slots=True)
class Seq:
    reverse: bool
    tokens: int = 0
    table: list[int] = attrs.field(factory=list)
    host: dict[int, int] = attrs.field(factory=dict)
    """Logical position -> host slot, for positions whose KV is only on the host."""
    swapped: bool = False
    """Swapped out whole: `table` is empty, and `host` holds every position or, with the
    table's copy space, the checkpoints and `copy` the rest (engine/memory/slot_swap.py)."""
    copy: list[int] = attrs.field(factory=list)
    """Swapped out into the copy space: the host block holding logical block j, its slots at
    the device block's offsets."""
    masked: set[int] = attrs.field(factory=set)
    """Of `copy`, the logical blocks copied slot by slot (shared with another owner)."""


class SlotQueries:
    """What BidirectionalBlocks answers without changing: per request and per block."""

    block_size: int
    _seqs: dict[int, Seq]
    _blocks: dict[int, Block]

    def table(self, rid: int) -> list[int]:
        """The request's signed block table entries, in token order."""
        return list(self._seqs[rid].table)

    def entries(self, rid: int) -> list[int]:
        """`table` without the copy (read only; it changes with the table)."""
        return self._seqs[rid].table

    def tokens(self, rid: int) -> int:
        return self._seqs[rid].tokens

    def is_reversed(self, rid: int) -> bool:
        return self._seqs[rid].reverse

    def displaced(self, rid: int) -> bool:
        """Some of the request's KV is only on the host: it cannot run before `restore`."""
        return bool((s := self._seqs[rid]).host) and not s.swapped

    def swapped(self, rid: int) -> bool:
        return self._seqs[rid].swapped

    def holdings(self) -> Iterator[tuple[int, int, int]]:
        """(request, device blocks, slots held only on the host) of every request."""
        bs = self.block_size
        return ((rid, 0, s.tokens) if s.swapped else (rid, -(-s.tokens // bs), len(s.host))
                for rid, s in self._seqs.items())

    def checkpointed_slots(self, rid: int) -> int:
        """Slots of the request held only on the host."""
        s = self._seqs[rid]
        return s.tokens if s.swapped else len(s.host)

    def checkpointed_blocks(self, rid: int) -> int:
        """Logical blocks of the request with a slot held only on the host."""
        if (s := self._seqs[rid]).swapped:
            return -(-s.tokens // self.block_size)
        return len(set(map(self.block_size.__rfloordiv__, s.host)))  # p // bs

    def block(self, b: int) -> tuple[int, int, int, int, frozenset[int]]:
        """(RT owner, RT fill, BE owner, BE fill, overwritten BE offsets) of block b; -1 = none."""
        x = self._blocks[b]
        return x.rt, x.rt_fill, x.be, x.be_fill, frozenset(x.lost)

    def shared_blocks(self) -> int:  # blocks holding both an RT and a BE request's KV
        return sum(1 for x in self._blocks.values() if x.rt >= 0 and x.be >= 0)

    def live_slots(self, rid: int) -> Iterator[tuple[int, int]]:
        """(logical position, device slot) of every position the request holds on the device."""
        s = self._seqs[rid]
        for pos in range(s.tokens if not s.swapped else 0):
            if pos not in s.host:
                yield pos, physical_slot(s.table[pos // self.block_size], pos % self.block_size,
                                         self.block_size)

    def host_slots(self, rid: int) -> dict[int, int]:
        """Logical position -> host slot of what the request holds only on the host."""
        s, bs = self._seqs[rid], self.block_size
        if not s.copy:
            return dict(s.host)
        rev = s.reverse
        return {pos: s.host[pos] if pos in s.host else
                s.copy[pos // bs] * bs + (bs - 1 - pos % bs if rev else pos % bs)
                for pos in range(s.tokens)}


def guest_block(slots: int, block_size: int, seqs: Iterable[Seq],
                blocks: Mapping[int, Block]) -> int | None:
    """The RT-only block with the most empty slots (then the lowest id), if it has `slots` of
    them (§5.2 FindBlock: "the maximum number of empty slots in each block"). Only an RT
    request's last block can have empty slots, so only those are looked at. RT's next writes
    there checkpoint the guest's slots first, as in any shared block."""
    best = (slots - 1, 1, None)  # (empty slots, -id, id): a block needs `slots` to beat it
    for s in seqs:
        if not s.reverse and s.table and (x := blocks[b := s.table[-1]]).be < 0:
            best = max(best, (block_size - x.rt_fill, -b, b))
    return best[2]
