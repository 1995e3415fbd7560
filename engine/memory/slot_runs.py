"""KV slots one by one (BROS §5): block table entries that carry a direction, flat slot addresses
(`block * block_size + offset`), the copies a change of the bidirectional table needs, which of
them merge into one call and which blocks they touch. Pure arithmetic, shared by the table
(engine/memory/bidirectional.py), the torch copier (gpu/slot_copy.py) and the simulator's."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

def encode(block: int, reverse: bool) -> int:
    """The block table entry of `block` read in one direction."""
    return -block - 1 if reverse else block


def decode(entry: int) -> tuple[int, bool]:
    """(block, reversed) of a block table entry."""
    return (-entry - 1, True) if entry < 0 else (entry, False)


def physical_slot(entry: int, offset: int, block_size: int) -> int:
    """Flat slot of logical `offset` within the block `entry` names."""
    block, rev = decode(entry)
    return block * block_size + (block_size - 1 - offset if rev else offset)


@attrs.frozen(kw_only=True)
class SlotCopies:
    """Copies one change needs, to run in this order before the step that writes the KV."""

    out: tuple[tuple[int, int], ...] = ()
    """(device slot, host slot): checkpoints and swap-outs, device -> host."""
    move: tuple[tuple[int, int], ...] = ()
    """(device slot, device slot): a BE block's surviving slots merged into a fresh block."""
    into: tuple[tuple[int, int], ...] = ()
    """(host slot, device slot): checkpointed or swapped-out slots coming back."""

    def __add__(self, other: SlotCopies) -> SlotCopies:
        return SlotCopies(out=self.out + other.out, move=self.move + other.move,
                          into=self.into + other.into)

    def __bool__(self) -> bool:
        return bool(self.out or self.move or self.into)


NO_COPIES = SlotCopies()
"""What most extensions need: nothing (shared, so the hot path allocates none)."""

SlotDirection = str
"""`out` (device -> host), `in` (host -> device) or `move` (device -> device)."""


def slot_runs(pairs: Sequence[tuple[int, int]], block_size: int) -> list[tuple[int, int, int]]:
    """(first source slot, first destination slot, length) of each run of pairs consecutive on
    both sides and within one block on both sides, in the given order; except that whole
    blocks, aligned on both sides and consecutive on both sides, are one run across blocks
    (a block group: the arena is block-major, so such a run is one contiguous copy; a whole
    request swapped out, engine/memory/slot_swap.py). A run longer than a block is always
    whole blocks."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs:
            s, d, n = runs[-1]
            if src == s + n and dst == d + n and (
                    ((s + n - 1) // block_size == src // block_size
                     and (d + n - 1) // block_size == dst // block_size)
                    or (n % block_size == 0 and s % block_size == 0 and d % block_size == 0)):
                runs[-1][2] += 1
                continue
        runs.append([src, dst, 1])
    out = []
    for s, d, n in runs:  # a group that ran on into a partial block: the partial part apart
        if n > block_size and n % block_size:
            whole = n - n % block_size
            out += [(s, d, whole), (s + whole, d + whole, n - whole)]
        else:
            out.append((s, d, n))
    return out


def moves_onto_sources(direction: SlotDirection, pairs: Sequence[tuple[int, int]]) -> bool:
    """A device move whose destinations include its own sources: only the given order is right,
    so it is never gathered (all reads before the writes)."""
    return direction == "move" and not {s for s, _ in pairs}.isdisjoint(d for _, d in pairs)


def slot_blocks(direction: SlotDirection, pairs: Sequence[tuple[int, int]],
                block_size: int) -> tuple[list[int], list[int]]:
    """(device blocks, host blocks) the copies touch, for the swapper's conflict tracking."""
    if direction == "move":
        return sorted({x // block_size for p in pairs for x in p}), []
    if direction == "out":
        return (sorted({g // block_size for g, _ in pairs}),
                sorted({h // block_size for _, h in pairs}))
    return sorted({g // block_size for _, g in pairs}), sorted({h // block_size for h, _ in pairs})
