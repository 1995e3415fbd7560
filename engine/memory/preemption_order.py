"""Which BE-only blocks an RT request preempts first on BROS's bidirectional table (§5.2,
FindPreemptBlock), found without keying every BE block.

The order (`BidirectionalBlocks._preempt_key`, largest first) is: blocks of BE requests already
displaced (a BE request loses its turn at its first overwritten slot, so spreading RT over many
BE requests' blocks would stop them all: bench/results/bros_bicache.md), then the most empty
slots (overwritten slots count as empty), then the lowest id; picked in one pass for all the
blocks an extension needs (no key changes while they are picked: checkpoints come after).
Keying every BE-only block on each pick was most of the scheduler's time under memory pressure
(1,200 blocks, 5 RT req/s: ~585 BE-only blocks keyed per pick). But only a request's last block
can be partly filled and only blocks with overwritten slots (`holed`) can have lost slots, so
every other BE-only block is full and keyed (displaced, -block_size, -id): of those, only the k
lowest ids of each kind can rank among the k largest. Property-tested against the full sort
(tests/engine/memory/test_bidirectional.py)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet

def preemption_order(k: int, be_only: AbstractSet[int], holed: AbstractSet[int],
                     last: Iterable[int], displaced: AbstractSet[int],
                     keys: Callable[[list[int]], list[tuple[bool, int, int]]]) -> list[int]:
    """The k blocks of `be_only` with the largest key, largest first. `last`: each BE
    request's last block; `displaced`: the blocks of displaced BE requests (the table keeps
    this set as requests become displaced and stop being so, rather than rebuilding it from
    every displaced table per pick: ~40 us of a ~110 us pick at 12 RT/s on 3,500 blocks);
    `holed`: blocks that may hold overwritten slots (a superset is fine); `keys`: the keys of a
    list of blocks, each ending in -block (so no two are equal), computed in one call (a call
    per block was most of a pick: ~200 blocks keyed, 12 RT req/s on 3,500)."""
    exact = set(holed)
    exact.update(last)
    exact &= be_only
    full = heapq.nsmallest(k, (displaced & be_only) - exact)
    # one set difference over be_only instead of two: exact (a few dozen) removed in place
    rest = be_only - displaced
    rest -= exact
    others = heapq.nsmallest(k, rest)  # no sort of every BE block
    return [-key[-1] for key in heapq.nlargest(k, keys([*exact, *full, *others]))]
