"""Whole requests out of the bidirectional table and back through its copy space
(engine/memory/slot_swap.py, BROS §5.2's extreme case): block groups for the blocks a request
holds alone, slot-masked copies for the blocks it shares, and the other owner's slots untouched."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.memory.bidirectional import BidirectionalBlocks, decode
from engine.memory.slot_runs import slot_runs
from engine.memory.slot_swap import HostBlocks, take_runs
from gpu.slot_copy import copy_slots
from tests.conftest import slow_scale
from tests.engine.memory.test_bidirectional import BS, SlotModel, _play, ops


class CopySpaceModel(SlotModel):
    """A whole-block copy also moves slots nobody wrote (beyond a fill): they carry nothing."""

    def apply(self, c) -> None:
        self.last = c
        for src, dst in c.out:
            self.host[dst] = self.device.get(src)
        moved = {dst: self.device.get(src) for src, dst in c.move}
        self.device.update(moved)
        for src, dst in c.into:
            self.device[dst] = self.host.get(src)


def test_runs_merge_whole_aligned_blocks_across_blocks():
    # blocks 2 and 3 whole onto host blocks 7 and 8: one run; then a partial block apart
    pairs = [(s, 28 + s - 8) for s in range(8, 16)] + [(16, 36), (17, 37)]
    assert slot_runs(pairs, BS) == [(8, 28, 8), (16, 36, 2)]
    # a partial run never crosses into the next block, nor does a misaligned one
    assert slot_runs([(2, 2), (3, 3), (4, 4)], BS) == [(2, 2, 2), (4, 4, 1)]
    assert slot_runs([(s, s + 1) for s in range(4, 12)], BS) == [(4, 5, 3), (7, 8, 1),
                                                                 (8, 9, 3), (11, 12, 1)]


def test_host_blocks_and_free_runs_take_few_runs():
    space = HostBlocks(range(10, 20))
    a = space.take(3)
    b = space.take(4)
    assert a == [10, 11, 12] and b == [13, 14, 15, 16] and space.num_free == 3
    space.give(a)
    assert space.take(5) == [10, 11, 12, 17, 18] and space.num_free == 1
    free = [9, 3, 4, 7, 5, 8]
    assert take_runs(free, 3) == [3, 4, 5] and free == [9, 7, 8]


def test_a_shared_block_goes_out_masked_and_the_others_in_one_group():
    t = BidirectionalBlocks(range(4), BS, host_slots=8, copy_blocks=range(2, 8))
    m = CopySpaceModel(t)
    t.add(1, reverse=True)
    m.extend(1, 3 * BS - 1)  # blocks 0, 1 whole, block 2 with one empty slot
    t.add(2, reverse=False)
    m.extend(2, BS)  # a free block: block 3
    m.extend(2, BS + 2)  # the BE block with the most empty slots: block 2, one slot overwritten
    assert decode(t.table(2)[1])[0] == 2 and t.displaced(1)
    out = t.swap_out(1)
    m.apply(out)
    m.check()  # RT's slots in block 2 untouched, every BE position on the host
    runs = slot_runs(out.out, BS)
    assert runs[0][2] == 2 * BS, "blocks 0 and 1 in one copy"
    assert [n for _, _, n in runs[1:]] == [2], "block 2: BE's two live slots, masked"
    assert [p[0] for p in out.out[2 * BS:]] == [2 * BS + 2, 2 * BS + 3]
    t.free(2)
    into = t.swap_in(1)
    m.apply(into)
    m.check()
    assert not t.swapped(1) and not t.displaced(1) and t.free_copy_blocks == 6
    assert sum(1 for _, _, n in slot_runs(into.into, BS) if n > BS) == 1
    t.free(1)
    assert t.num_free == 4 and t.free_host_slots == 8


@settings(max_examples=slow_scale(300, 60), deadline=None)
@given(blocks=st.integers(1, 8), host=st.integers(0, 24), copy=st.integers(0, 10), program=ops,
       rt_first=st.booleans())
def test_random_use_with_a_copy_space_keeps_every_slot_owned_once(blocks, host, copy, program,
                                                                 rt_first):
    first = -(-host // BS)  # copy blocks after the checkpoint slots, as the engine lays them
    t = BidirectionalBlocks(range(blocks), BS, host_slots=host,
                            copy_blocks=range(first, first + copy))
    m = CopySpaceModel(t)
    if rt_first:
        for b in range(blocks):
            t.add(b, reverse=False)
            if t.can_extend(b, 1 + b % (BS - 1)):
                m.extend(b, 1 + b % (BS - 1))
    t.add(100, reverse=True)
    if t.can_extend(100, blocks * BS - 1):
        m.extend(100, blocks * BS - 1)
    _play(t, m, program, next_id=200)
    for rid in t.requests():
        t.free(rid)
    assert (t.num_free, t.free_host_slots, t.free_copy_blocks) == (blocks, host, copy)


def test_torch_copies_a_group_run_in_one_call():
    dev = torch.arange(6 * 2 * 2 * BS * 3, dtype=torch.float32).reshape(6, 2, 2, BS, 1, 3)
    host = torch.zeros(8, 2, 2, BS, 1, 3)
    pairs = [(s, 3 * BS + s - BS) for s in range(BS, 3 * BS)] + [(5 * BS + 1, 6 * BS + 1)]
    calls, _ = copy_slots("out", pairs, dev, host)
    assert calls == 2
    assert torch.equal(host[3:5], dev[1:3]) and torch.equal(host[6, :, :, 1], dev[5, :, :, 1])
    assert host[6, :, :, 0].abs().sum() == 0 and host[5].abs().sum() == 0
