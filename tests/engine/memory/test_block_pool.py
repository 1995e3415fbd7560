"""BlockPool invariants, checked with hypothesis over random allocate/free sequences."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.memory.block_pool import BlockPool, BlockPoolError


def test_allocate_and_free_round_trip():
    pool = BlockPool(range(10, 20))
    got = pool.allocate(1, 3) + pool.allocate(1, 2)
    assert pool.table(1) == got and len(set(got)) == 5 and all(10 <= b < 20 for b in got)
    assert pool.num_free == 5
    assert pool.free(1) == 5 and pool.num_free == 10 and pool.table(1) == []


def test_over_allocation_is_refused_and_changes_nothing():
    pool = BlockPool(range(4))
    pool.allocate(1, 3)
    with pytest.raises(BlockPoolError, match="request 2 asked for 2 blocks, 1 free"):
        pool.allocate(2, 2)
    assert pool.num_free == 1 and pool.table(2) == []


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5), st.integers(0, 6)),
               max_size=60)


@given(ops)
def test_no_block_is_owned_twice_or_lost(seq):
    pool = BlockPool(range(32))
    for op, rid, n in seq:
        if op == "alloc" and pool.can_allocate(n):
            pool.allocate(rid, n)
        elif op == "free":
            pool.free(rid)
        owned = [b for t in pool.owners().values() for b in t]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + pool.num_free == 32, "a block was lost"
        assert set(owned).isdisjoint(pool._free)
