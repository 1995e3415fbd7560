"""bench/bros_rt_hold.py's count of refused swap-backs "a guest could take" (issue 14, round 11,
bench/results/bros_round11_be.md): a BE request's missing block is its partly filled last one,
which needs a fresh block (its RT owner is still there, or it is swapped out), and an RT block's
empty right side has room for it."""

from __future__ import annotations

import sys
from pathlib import Path

from engine.memory.bidirectional import BidirectionalBlocks

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.bros_rt_hold import _guest_could_take  # noqa: E402

BS = 4


def _displaced_last_block() -> BidirectionalBlocks:
    """RT 1 in block 0 (one slot), BE 2 in blocks 1 and 2 (4 + 2 slots), RT 3 in block 3 and
    then in block 2, whose BE slot at offset 2 it overwrites: BE 2 is displaced in its last
    block, no block is free, and block 0 has 3 empty slots."""
    t = BidirectionalBlocks(range(4), BS, host_slots=16)
    t.add(1, reverse=False)
    t.extend(1, 1)
    t.add(2, reverse=True)
    t.extend(2, 6)
    t.add(3, reverse=False)
    t.extend(3, 1)
    t.extend(3, 7)
    assert t.displaced(2) and t.num_free == 0 and t.restore_blocks_needed(2) == 1
    return t


def test_a_displaced_partial_last_block_fits_a_guest() -> None:
    t = _displaced_last_block()
    assert _guest_could_take(t, 2)
    t.extend(1, 4)  # RT 1 fills block 0: no RT block has empty slots left
    assert not _guest_could_take(t, 2)


def test_no_guest_when_the_last_block_needs_no_fresh_one() -> None:
    t = _displaced_last_block()
    t.free(3)  # RT 3 leaves block 2: the restore is in place there
    assert t.displaced(2) and t.restore_blocks_needed(2) == 0
    assert not _guest_could_take(t, 2)


def test_a_swapped_request_needs_a_partial_last_block() -> None:
    t = BidirectionalBlocks(range(4), BS, host_slots=32)
    t.add(1, reverse=False)
    t.extend(1, 1)  # block 0, 3 empty slots
    for rid, tokens in ((2, 6), (3, 8)):
        t.add(rid, reverse=True)
        t.extend(rid, tokens)
        t.swap_out(rid)
    assert _guest_could_take(t, 2)  # 4 + 2: its last block fits block 0's empty side
    assert not _guest_could_take(t, 3)  # 4 + 4: no partial block, a guest cannot help
