"""Block-group manager (FastSwitch §3.1): invariants under random use, and group granularity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.memory.block_groups import BlockGroupManager, FreeRuns
from engine.memory.block_pool import BlockPoolError
from tests.conftest import slow_scale


def check_invariants(m: BlockGroupManager, ids: range) -> None:
    covered: list[int] = []
    for rid in m.owners():
        for g in m.groups(rid):
            assert 0 <= g.used <= g.reserved
            covered.extend(range(g.start, g.start + g.reserved))
    runs = m.free_runs()
    for (s1, l1), (s2, _) in zip(runs, runs[1:]):
        assert s1 + l1 < s2, "free runs must be sorted and merged"
    for s, n in runs:
        covered.extend(range(s, s + n))
    assert sorted(covered) == list(ids), "every block is reserved by exactly one owner or free"
    tables = [b for t in m.owners().values() for b in t]
    assert len(tables) == len(set(tables)), "a block is owned twice"
    assert m.num_free == len(ids) - len(tables)
    for rid in m.owners():
        assert [b for s, n in m.runs(rid) for b in range(s, s + n)] == m.table(rid)


def test_free_runs_merge_with_both_neighbours():
    f = FreeRuns()
    f.add(0, 2)
    f.add(5, 3)
    f.add(2, 3)
    assert f.runs() == [(0, 8)]


def test_a_growing_request_stays_in_one_group():
    m = BlockGroupManager(range(100, 400), expected_group=60)
    for _ in range(50):
        m.allocate(1, 1)
    assert m.runs(1) == [(100, 50)]
    assert m.num_free == 250


def test_a_second_request_takes_a_fresh_group_then_steals_spare_tails():
    m = BlockGroupManager(range(0, 100), expected_group=60)
    m.allocate(1, 10)      # reserves 25 (a quarter of what is free), uses 10
    m.allocate(2, 70)      # all the free space left is 75
    assert m.num_free == 20
    m.allocate(3, 12)      # free runs: 5 blocks; then the spare tail of request 1 is split off
    check_invariants(m, range(0, 100))
    assert len(m.table(3)) == 12


def test_a_used_groups_spare_tail_is_split_before_a_shorter_free_group_is_taken():
    """Issue 13, defect 2 (FastSwitch §3.1): a *matching* free group first; when none matches,
    another request's active group gives up part of its free space, so the newcomer's KV stays
    one run instead of a short free run plus a stolen remainder."""
    m = BlockGroupManager(range(0, 100), expected_group=60)
    m.allocate(1, 10)      # reserves 25, spare 15
    m.allocate(2, 70)      # leaves one free run of 5 at the end
    assert m.free_runs() == [(95, 5)]
    m.allocate(3, 12)
    assert m.runs(3) == [(13, 12)] and m.groups(1)[-1].reserved == 13
    assert m.free_runs() == [(95, 5)]
    check_invariants(m, range(0, 100))
    old = BlockGroupManager(range(0, 100), expected_group=60, split_tails=False)
    for rid, n in ((1, 10), (2, 70), (3, 12)):
        old.allocate(rid, n)
    assert old.runs(3) == [(95, 5), (18, 7)]   # the order kept before: a free run first


def test_freeing_merges_back_into_one_run():
    m = BlockGroupManager(range(0, 64), expected_group=8)
    for rid in range(1, 6):
        m.allocate(rid, 5)
    for rid in (2, 4, 1, 5, 3):
        m.free(rid)
    assert m.free_runs() == [(0, 64)]


def test_over_allocation_is_refused():
    m = BlockGroupManager(range(8))
    m.allocate(1, 6)
    with pytest.raises(BlockPoolError, match="request 2 asked for 3 blocks, 2 free"):
        m.allocate(2, 3)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "expect"]),
                         st.integers(0, 7), st.integers(0, 30)), max_size=80)


@settings(max_examples=slow_scale(1500, 300), deadline=None)
@given(ops, st.integers(1, 70), st.booleans())
def test_no_block_owned_twice_none_lost_free_space_merged(seq, expected, split_tails):
    ids = range(1000, 1128)
    m = BlockGroupManager(ids, expected_group=expected, split_tails=split_tails)
    for op, rid, n in seq:
        if op == "alloc" and m.can_allocate(n):
            m.allocate(rid, n)
        elif op == "free":
            m.free(rid)
        elif op == "expect":
            m.expect(rid, n)
        check_invariants(m, ids)
