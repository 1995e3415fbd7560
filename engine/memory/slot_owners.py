"""The records of BROS's bidirectional block table (engine/memory/bidirectional.py): who owns
each block's two sides and how far each fills it, and each request's signed block table and host
slots; and the search for a guest block (§5.2 FindBlock: a BE request's last block placed in the
empty right side of an RT block)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs


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
    """Swapped out whole: `host` holds every position, `table` is empty."""


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
