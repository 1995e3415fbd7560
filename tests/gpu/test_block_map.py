"""A member's group-id -> stage-block map (gpu/block_map.py): adopted requests' kept KV is
used where it lies, also when the head's allocator hands them ids the member has seen before."""

from types import SimpleNamespace

import numpy as np
import pytest

from gpu.block_map import BlockMap


def _map(blocks: int = 8) -> BlockMap:
    view = SimpleNamespace(capacity=blocks, num_blocks=blocks,
                           usable=np.arange(blocks, dtype=np.int64))
    return BlockMap(view, range(blocks))


def test_a_fresh_id_takes_the_reserved_block():
    m = _map()
    m.reserve(7, [5, 6])
    assert m.assign(7, 0, 2) is None and m.assign(7, 1, 3) is None
    m.done_reserving(7)
    assert m.locals([2, 3]) == [5, 6] and m.copied_blocks == 0


def test_a_reused_id_nobody_holds_moves_onto_the_reserved_block():
    """The case CI met: a finished request's group id handed to an adopted one."""
    m = _map()
    m.reserve(7, [5])
    assert m.assign(1, 0, 2) is None  # request 1 gets stage block 0 for group id 2 ...
    old = m.local(2)
    # ... finishes; the allocator hands id 2 to the adopted request 7
    assert m.assign(7, 0, 2, in_use=lambda g: False) is None
    assert m.local(2) == 5 and m.copied_blocks == 0
    m.done_reserving(7)
    # the id's old stage block is free again, and the reserved one is not handed out twice
    taken = {m.local(g) for g in (2,)}
    got = [m.assign(9, i, g) for i, g in enumerate((0, 1, 3, 4, 6, 7))]
    assert got == [None] * 6
    fresh = {m.local(g) for g in (0, 1, 3, 4, 6, 7)}
    assert old in fresh and not (fresh & taken) and len(fresh) == 6


def test_a_reused_id_still_held_is_copied_and_counted():
    """A shared prefix block another live request reads: its stage block stays; the adopted
    request's KV is copied into it."""
    m = _map()
    m.reserve(7, [5])
    m.assign(1, 0, 2)
    held = m.local(2)
    assert m.assign(7, 0, 2, in_use=lambda g: g == 2) == (5, held)
    assert m.local(2) == held and m.copied_blocks == 1
    m.done_reserving(7)  # the unused reservation is free again
    assert 5 in {m.local(g) for g in range(3, 8) if m.assign(9, g, g) is None}


def test_the_pool_cannot_outgrow_the_member():
    view = SimpleNamespace(capacity=2, num_blocks=2, usable=np.arange(2))
    with pytest.raises(ValueError, match="cannot hold a group pool of 3"):
        BlockMap(view, range(3))


def test_an_entry_with_no_block_in_place_gets_a_fresh_one_after_every_reservation():
    """A merged member's kept KV (gpu/kept_kv.py): entries whose KV could not stay in place
    (None) get free blocks once every in-place block is reserved, never one of those."""
    m = _map()
    m.reserve(7, [None, 1, None])
    m.reserve(8, [0])  # reserved after 7's: `fresh` must not have handed block 0 out before
    got = m.fresh(7)
    assert [i for i, _ in got] == [0, 2] and {b for _, b in got}.isdisjoint({0, 1}), got
    assert m.fresh(8) == []
    for i, g in enumerate((4, 5, 6)):
        assert m.assign(7, i, g) is None
    m.done_reserving(7)
    assert m.locals([4, 5, 6]) == [got[0][1], 1, got[1][1]] and m.copied_blocks == 0
    assert m.assign(8, 0, 3) is None and m.local(3) == 0
