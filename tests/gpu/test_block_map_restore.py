"""A member's block map as its group restores (gpu/block_map.py `move`, `evacuate`): the
head's pool shrinking back moves ids without copying KV, and a restore prefetch vacates the
dropped layers' stage blocks (gpu/restore_prefetch.py) so the weights can be written there while
the group serves."""

from types import SimpleNamespace

import numpy as np
import pytest

from gpu.block_map import BlockMap, copy_order


def _map(blocks: int = 8) -> BlockMap:
    view = SimpleNamespace(capacity=blocks, num_blocks=blocks,
                           usable=np.arange(blocks, dtype=np.int64))
    return BlockMap(view, range(blocks))


def test_a_moved_id_means_the_same_stage_block_and_frees_its_old_one():
    m = _map()
    for i, g in enumerate((6, 2)):
        m.assign(1, i, g)  # id 6 -> stage block 0, id 2 -> stage block 1
    m.move([(6, 3)])  # the pool shrank below 6: its entry became id 3
    assert m.local(3) == 0
    with pytest.raises(KeyError, match="group block 6 has no stage block"):
        m.local(6)
    m.move([(2, 4)])
    assert m.local(4) == 1
    assert m.assign(2, 0, 5) is None and m.local(5) == 2  # nothing freed was lost or doubled
    with pytest.raises(KeyError, match="group block 7 moved to 0 has no stage block"):
        m.move([(7, 0)])


def test_a_moved_onto_id_seen_before_gives_its_stale_block_back():
    m = _map(3)
    m.assign(1, 0, 0)  # stage 0 (a finished request's: stale KV)
    m.assign(2, 0, 2)  # stage 1
    m.move([(2, 0)])
    assert m.local(0) == 1
    assert m.assign(3, 0, 1) is None and m.local(1) == 0  # stage 0 is free again


def test_evacuate_moves_every_pool_id_out_and_never_hands_those_blocks_out_again():
    m = _map(8)
    for i, g in enumerate((0, 1, 2, 3, 4)):
        m.assign(1, i, g)  # stage blocks 0..4
    avoid = np.zeros(8, dtype=bool)
    avoid[[0, 1, 2, 7]] = True  # the dropped layers' memory (block 7 held nothing)
    copies = m.evacuate(avoid, range(4))  # id 4 is beyond the shrunk pool
    assert sorted(src for src, _ in copies) == [0, 1, 2]
    assert all(not avoid[dst] for _, dst in copies)
    assert [m.local(g) for g in (0, 1, 2)] == [dst for _, dst in copies]
    assert m.local(3) == 3
    with pytest.raises(KeyError):
        m.local(4)  # unmapped: its block (4) is free again
    assert sorted(dst for _, dst in copies) == [4, 5, 6]  # id 4's block was given back first
    with pytest.raises(RuntimeError, match="no free stage block left"):
        m.assign(2, 0, 5)  # blocks 0..2 and 7 are the weights' now
    m.move([(3, 5)])  # nor does a move give one back
    assert m.local(5) == 3


def test_evacuate_refuses_a_pool_larger_than_what_lies_outside():
    m = _map(4)
    for i, g in enumerate((0, 1, 2)):
        m.assign(1, i, g)
    avoid = np.array([True, True, False, False])
    with pytest.raises(RuntimeError, match="2 blocks must leave the dropped layers' memory and "
                                           "only 1 stage blocks outside it are free"):
        m.evacuate(avoid, range(4))


def test_evacuate_moves_a_reserved_block_and_the_reservation_follows():
    """An adopted request whose table has not come yet: its kept KV moves out with the
    rest, and its table then takes the new block."""
    m = _map()
    m.reserve(7, [1, 5])
    avoid = np.zeros(8, dtype=bool)
    avoid[1] = True
    copies = m.evacuate(avoid, range(8))
    assert len(copies) == 1 and copies[0][0] == 1 and not avoid[copies[0][1]]
    assert m.assign(7, 0, 3) is None and m.assign(7, 1, 4) is None
    assert m.locals([3, 4]) == [copies[0][1], 5]


def _apply(m: BlockMap, copies, held: dict[int, int]) -> list:
    """Stage blocks' contents after `copies` run in order (`held`: id -> its block before)."""
    blocks: list = [None] * len(m._taken)
    for g, b in held.items():
        blocks[b] = f"kv of {g}"
    for src, dst in copies:
        blocks[dst] = blocks[src]
    return blocks


def test_place_moves_each_id_home_in_an_order_that_overwrites_nothing_still_needed():
    """The head's restore prefetch (gpu/restore_prefetch.py): each id's kept KV goes to its
    home (where its solo block's layers lie). Ids 0 and 1 sit on each other's homes (a cycle:
    one steps aside to a block that is no id's home), id 2's home is free, id 3 is home,
    id 4's home is held by a reservation (it stays)."""
    m = _map(10)
    for i, g in enumerate((0, 1, 2, 3, 4)):
        m.assign(1, i, g)  # stage blocks 0..4
    m.reserve(9, [8])
    held = {g: m.local(g) for g in range(5)}
    homes = {0: 1, 1: 0, 2: 6, 3: 3, 4: 8, 5: 7}
    m.home(homes.get, range(6))
    copies = m.place(range(6))
    blocks = _apply(m, copies, held)
    for g in range(4):
        assert m.local(g) == homes[g] and blocks[homes[g]] == f"kv of {g}", (g, copies)
    assert m.local(4) == 4 and blocks[4] == "kv of 4"
    assert (m.placed_blocks, m.aside_blocks) == (3, 1)
    assert all(dst not in homes.values() for src, dst in copies if src in (0, 1)
               and dst not in (0, 1)), copies  # the spare is no id's home
    assert m.assign(1, 5, 5) is None and m.local(5) == 7  # a new id gets its home at once
    assert m.assign(1, 6, 9) is None and m.local(9) not in homes.values()  # (no home: any
    # free block but another id's home)


def test_copy_order_never_overwrites_a_block_still_to_be_read():
    """The head's restore's step (gpu/kept_kv.py `place_own`): its kept KV copied to where
    its solo blocks' layers lie, inside the arena. 0 -> 1 -> 2 is a chain (2 is read before it
    is written), 3 <-> 4 a cycle (one goes round the spare block 9), 5 stays."""
    moves = [(0, 1), (1, 2), (2, 6), (3, 4), (4, 3), (5, 5)]
    asked = []

    def spare(avoid):
        asked.append(avoid)
        return 9

    order = copy_order(moves, spare)
    blocks = [f"kv {b}" for b in range(10)]
    for src, dst in order:
        blocks[dst] = blocks[src]
    for src, dst in moves:
        assert blocks[dst] == f"kv {src}", (src, dst, order)
    assert len(order) == 6 and all(9 not in a and {3, 4} <= a for a in asked), (order, asked)
    assert copy_order([(3, 4), (4, 3)], lambda avoid: None) is None  # no spare: gathered
