"""The host checkpoint space hands out one device block's lazy checkpoints in consecutive host
slots (engine/memory/host_slots.py), so that a block's checkpoints come back in one copy call
even when RT decodes in several shared blocks interleave, one overwritten slot a step each."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.memory.bidirectional import BidirectionalBlocks, decode
from engine.memory.host_slots import HostSlots
from engine.memory.slot_runs import slot_runs
from tests.engine.memory.test_bidirectional import BS, SlotModel
from tests.conftest import slow_scale
from tests.engine.memory.test_slot_swap import CopySpaceModel


def test_take_continues_a_run_and_leaves_room_for_it():
    h = HostSlots(10)
    a = h.take(None, 3)
    b = h.take(None, 3)  # a fresh run starts past the room the first one left
    assert (a, b) == (0, 3)
    assert h.take(a) == 1 and h.take(1) == 2 and h.take(b) == 4
    assert h.take(2) == 6, "the slot after 2 is taken: a fresh one from the cursor on"
    assert len(h) == 4
    h.give([0, 1])
    assert h.take(None, 2) == 7 and h.take(None) == 9, "8 is left for 7's run"
    assert h.take(None) == 0, "the cursor wraps"
    with pytest.raises(ValueError, match="host slot 2 given back twice"):
        h.give([2, 2])


def test_an_empty_space_refuses():
    h = HostSlots(1)
    h.take()
    with pytest.raises(IndexError, match="empty host checkpoint space"):
        h.take(0)


@settings(max_examples=slow_scale(300, 60), deadline=None)
@given(n=st.integers(1, 12), program=st.lists(st.tuples(st.booleans(), st.integers(0, 11),
                                                        st.integers(0, 5)), max_size=60))
def test_random_takes_and_gives_never_hand_out_a_taken_slot(n, program):
    h, taken = HostSlots(n), set()
    for take, pick, room in program:
        if take and len(h):
            after = sorted(taken)[pick % len(taken)] if taken and pick % 3 else None
            slot = h.take(after, room)
            assert slot not in taken and 0 <= slot < n, f"slot {slot} handed out twice"
            assert after is None or after + 1 in taken or after + 1 == n or slot == after + 1
            taken.add(slot)
        elif taken:
            slot = sorted(taken)[pick % len(taken)]
            h.give([slot])
            taken.discard(slot)
        assert len(h) == n - len(taken)


def _interleaved(t: BidirectionalBlocks, m: SlotModel) -> tuple[int, int]:
    """BE 1 and 2 fill a block each; RT 3 and 4 take them and decode in turn, each step
    overwriting one BE slot of its block. Returns the two blocks."""
    for rid in (1, 2):
        t.add(rid, reverse=True)
        m.extend(rid, BS)
    for rid in (3, 4):
        t.add(rid, reverse=False)
        m.extend(rid, 1, grow=True)
    for tokens in range(2, BS):
        for rid in (3, 4):
            m.extend(rid, tokens, grow=True)
            assert len(m.last.out) == 1
    assert t.checkpointed_slots(1) == t.checkpointed_slots(2) == BS - 1
    m.check()
    return decode(t.table(1)[0])[0], decode(t.table(2)[0])[0]


def _interleaved_then_rt_gone() -> tuple[BidirectionalBlocks, SlotModel]:
    """`_interleaved`, then both RT requests end: BE 1 and 2 hold their checkpoints."""
    t = BidirectionalBlocks(range(2), BS, host_slots=4 * BS)
    m = SlotModel(t)
    _interleaved(t, m)
    t.free(3)
    t.free(4)
    return t, m


def test_interleaved_decodes_restore_each_block_in_one_call():
    t, m = _interleaved_then_rt_gone()
    for rid in (1, 2):
        c = t.restore(rid)
        assert len(c.into) == BS - 1 and not c.move
        assert len(slot_runs(c.into, BS)) == 1, f"restore of {rid} in {c.into}"
        m.apply(c)
        m.check()
    assert t.free_host_slots == 4 * BS


def test_a_steps_overwrites_in_one_block_go_out_in_one_call():
    t, m = _interleaved_then_rt_gone()
    m.apply(t.restore(1))
    m.apply(t.restore(2))
    t.add(5, reverse=False)
    m.extend(5, BS - 1)  # RT over request 1's block: three slots in one step
    assert len(m.last.out) == BS - 1 and len(slot_runs(m.last.out, BS)) == 1
    m.check()


def test_swap_in_brings_a_blocks_checkpoints_back_in_one_call():
    t = BidirectionalBlocks(range(2), BS, host_slots=4 * BS, copy_blocks=range(4 * BS, 5 * BS))
    m = CopySpaceModel(t)
    _interleaved(t, m)
    m.apply(t.swap_out(1))  # one live slot, masked: the rest are checkpoints
    t.free(3)
    c = t.swap_in(1)
    assert len(c.into) == BS
    assert len(slot_runs(c.into, BS)) == 2, f"the masked slot, then the checkpoints: {c.into}"
    m.apply(c)
    m.check()
