"""One step's slot copies batched by direction (BROS §5.2: "all swapping operations are
consolidated"), so that a copier that gathers (gpu/slot_copy.py) copies each batch in one call.

The bidirectional table (engine/memory/bidirectional.py) returns its copies change by change,
each to run in the order given: RT request after RT request checkpoints the BE slots it is about
to overwrite, a displaced BE request swaps its checkpoints back, and so on. A copy may join an
earlier batch of its direction when it is independent of that batch and of every batch after it
(no slot one writes is read or written by the other), so that running it at the batch's place
and inside it (all of a batch's reads before its writes, as a gather does) leaves every slot as
the given order would. Otherwise it starts a batch of its own after them.

Slots are keyed per space: a device slot `s` as `s`, a host slot `h` as `~h` (negative).
"""

from __future__ import annotations

from collections.abc import Iterator

from engine.memory.slot_runs import NO_COPIES, SlotCopies, SlotDirection

Pairs = list[tuple[int, int]]


class _Batch:
    __slots__ = ("request_id", "direction", "pairs", "reads", "writes")

    def __init__(self, rid: int, direction: SlotDirection, pairs: Pairs, reads: set[int],
                 writes: set[int]) -> None:
        self.request_id = rid
        """The request of its first copy (the swap pool reports a failed copy against it)."""
        self.direction = direction
        self.pairs = pairs
        self.reads = reads
        self.writes = writes


def touched(direction: SlotDirection, pairs: Pairs) -> tuple[set[int], set[int]]:
    """(slots read, slots written) by `pairs`, keyed as the module says."""
    if direction == "out":  # device -> host
        return {s for s, _ in pairs}, {~h for _, h in pairs}
    if direction == "in":  # host -> device
        return {~h for h, _ in pairs}, {d for _, d in pairs}
    return {s for s, _ in pairs}, {d for _, d in pairs}


class StepCopies:
    """The copies of one step in as few batches as their order allows (`merge`), else one batch
    per change and direction, as given."""

    def __init__(self, *, merge: bool = True) -> None:
        self.merge = merge
        self._batches: list[_Batch] = []

    def add(self, rid: int, copies: SlotCopies) -> None:
        """Copies of request `rid`'s change, to run after those added before (out, move, in)."""
        if copies is NO_COPIES:  # most extensions of a step
            return
        for direction, pairs in (("out", copies.out), ("move", copies.move), ("in", copies.into)):
            if pairs:
                self._add(rid, direction, list(pairs))

    def _add(self, rid: int, direction: SlotDirection, pairs: Pairs) -> None:
        if not self.merge:
            self._batches.append(_Batch(rid, direction, pairs, set(), set()))
            return
        reads, writes = touched(direction, pairs)
        for b in reversed(self._batches):
            if not (writes.isdisjoint(b.reads) and writes.isdisjoint(b.writes)
                    and reads.isdisjoint(b.writes)):
                break  # it must run after b
            if b.direction == direction:
                b.pairs += pairs
                b.reads |= reads
                b.writes |= writes
                return
        self._batches.append(_Batch(rid, direction, pairs, reads, writes))

    def __iter__(self) -> Iterator[tuple[int, SlotDirection, tuple[tuple[int, int], ...]]]:
        """(request id, direction, pairs) of each batch, in the order they must run."""
        for b in self._batches:
            yield b.request_id, b.direction, tuple(b.pairs)

    def __len__(self) -> int:
        return len(self._batches)
