"""The free slots of BROS's host checkpoint space (engine/memory/bidirectional.py), handed out so
that the checkpoints of one device block sit in consecutive host slots.

RT overwrites a shared block's BE slots from the lowest offset up, one slot a decode step (§5.2,
lazy checkpointing): each is copied out just before it is overwritten, so a block's checkpoints
are taken at different steps. Given the host slot of the block's previous checkpoint, `take`
returns the slot after it when that one is free; a block's first checkpoint starts past the
room the last one left for its block. The slots RT overwrites in one step then go out as one
run, and a restore brings a block's checkpoints back as one run (engine/memory/slot_runs.py
merges pairs consecutive on both sides), where the host slots were one slot at a time before.
Only placement changes: a slot is still taken per checkpoint and given back when it comes back.
"""

from __future__ import annotations

from collections.abc import Iterable


class HostSlots:
    """Free host slot ids 0 .. n - 1: a byte per slot (1 = free) and a cursor for fresh runs."""

    def __init__(self, n: int) -> None:
        self._free = bytearray(b"\x01") * n
        self._count = n
        self._cursor = 0

    def __len__(self) -> int:
        return self._count

    def take(self, after: int | None = None, room: int = 1) -> int:
        """A free slot: `after + 1` when it is free (the next checkpoint of a block whose last
        one went to `after`); else the first free one from the cursor on (wrapping), and the
        cursor moves `room` slots past it, so that the block's next checkpoints find the slots
        after it free (`room`: how many of the block's slots may still be overwritten)."""
        if after is not None and after + 1 < len(self._free) and self._free[after + 1]:
            h = after + 1
        else:
            h = self._free.find(1, self._cursor)
            if h < 0:
                h = self._free.find(1)
            if h < 0:
                raise IndexError("take from an empty host checkpoint space")
            self._cursor = h + max(room, 1)
        self._free[h] = 0
        self._count -= 1
        return h

    def give(self, slots: Iterable[int]) -> None:
        """Slots back (their checkpoint came back, or its request ended)."""
        for h in slots:
            if self._free[h]:
                raise ValueError(f"host slot {h} given back twice")
            self._free[h] = 1
            self._count += 1
