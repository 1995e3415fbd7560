"""The bidirectional block table (BROS §5): placement, block preemption, lazy checkpointing, and
property tests run against a model of the device and host slots that every copy is applied to."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.memory.bidirectional import (
    BidirectionalBlocks,
    BidirectionalError,
    SlotCopies,
    decode,
    encode,
    physical_slot,
)
from tests.conftest import slow_scale

BS = 4


class SlotModel:
    """Device and host slots holding (request, position) tags: the copies each change returns
    are applied, then the change's new positions are written, as an engine step does."""

    def __init__(self, t: BidirectionalBlocks) -> None:
        self.t = t
        self.device: dict[int, tuple[int, int]] = {}
        self.host: dict[int, tuple[int, int]] = {}

    def apply(self, c: SlotCopies) -> None:
        self.last = c
        for src, dst in c.out:
            self.host[dst] = self.device[src]
        moved = {dst: self.device[src] for src, dst in c.move}
        self.device.update(moved)
        for src, dst in c.into:
            self.device[dst] = self.host[src]

    def extend(self, rid: int, tokens: int, *, grow: bool = False) -> None:
        before = self.t.tokens(rid)
        self.apply(self.t.grow(rid, tokens) if grow else self.t.extend(rid, tokens))
        table = self.t.table(rid)
        for pos in range(before, tokens):
            self.device[physical_slot(table[pos // BS], pos % BS, BS)] = (rid, pos)

    def check(self) -> None:
        t, seen = self.t, {}
        for rid in t.requests():
            host = t.host_slots(rid)
            for pos, slot in t.live_slots(rid):
                assert slot not in seen, f"slot {slot} held by {seen.get(slot)} and {rid}"
                seen[slot] = rid
                assert self.device[slot] == (rid, pos), "a live slot lost its KV"
            for pos, h in host.items():
                assert self.host[h] == (rid, pos), "a checkpoint does not hold its KV"
            assert len(host) == (t.tokens(rid) if t.swapped(rid) else
                                 t.tokens(rid) - sum(1 for _ in t.live_slots(rid)))
            # fit (engine/bidirectional_step.py) counts a request's blocks from this
            assert len(t.table(rid)) == (0 if t.swapped(rid) else -(-t.tokens(rid) // t.block_size))
        held = [h for rid in t.requests() for h in t.host_slots(rid).values()]
        assert len(held) == len(set(held)), "a host slot with two owners"
        # a checkpoint covers exactly the overwritten slots of each block
        for b in range(t.num_total):
            _, _, be, _, lost = t.block(b)
            if be >= 0:
                table = t.table(be)
                j = next(j for j, e in enumerate(table) if decode(e)[0] == b)
                ck = {BS - 1 - (p - j * BS) for p in t.host_slots(be) if p // BS == j}
                assert ck == set(lost)
            else:
                assert not lost
        owned = {decode(e)[0] for rid in t.requests() for e in t.table(rid)}
        assert t.num_free == t.num_total - len(owned)
        be_only = [b for b in range(t.num_total) if t.block(b)[0] < 0 and t.block(b)[2] >= 0]
        assert t.rt_room() == t.num_free + len(be_only)
        # the displaced requests' blocks (and the BE requests) the table keeps as it goes
        assert set(t._be) == {rid for rid in t.requests() if t.is_reversed(rid)}
        assert t._displaced == {decode(e)[0] for rid in t.requests()
                                if t.is_reversed(rid) and t.displaced(rid) for e in t.table(rid)}
        # block preemption's order, found without keying every BE block, is the full sort's
        by_key = sorted(be_only, key=t._preempt_key, reverse=True)
        for k in range(1, len(be_only) + 1):
            assert t._preemption_order(k) == by_key[:k]


def test_entries_carry_the_direction():
    assert encode(3, False) == 3 and encode(3, True) == -4 and encode(0, True) == -1
    assert decode(-4) == (3, True) and decode(3) == (3, False)
    assert physical_slot(encode(2, True), 0, 16) == 2 * 16 + 15
    assert physical_slot(encode(2, False), 0, 16) == 32


def test_rt_overwrites_be_slots_after_taking_the_empty_ones():
    t = BidirectionalBlocks(range(2), BS, host_slots=8)
    m = SlotModel(t)
    t.add(1, reverse=True)
    m.extend(1, 6)  # BE: block A full, block B two slots from the right
    t.add(2, reverse=False)
    m.extend(2, 4)
    m.extend(2, 5)  # RT fills ... both blocks have BE owners: the emptier one is taken first
    tables = t.table(2)
    rt_block = decode(tables[0])[0]
    assert t.block(rt_block)[2] == 1, "RT is a guest in a BE block"
    assert t.checkpointed_slots(1) > 0 and t.displaced(1)
    assert not t.can_extend(1, 7), "a displaced BE request cannot run"
    m.check()


def test_block_preemption_takes_a_displaced_requests_blocks_first():
    t = BidirectionalBlocks(range(8), BS, host_slots=32)
    m = SlotModel(t)
    for rid, tokens in ((1, 8), (2, 12), (3, 6)):  # BE: blocks 0-1, 2-4, and 5-6 (6 half full)
        t.add(rid, reverse=True)
        m.extend(rid, tokens)
    t.add(4, reverse=False)
    m.extend(4, 4)  # the free block 7
    m.extend(4, 8)  # the emptiest BE block, 6: two empty slots, two overwritten
    assert decode(t.table(4)[1])[0] == 6 and t.displaced(3)
    m.extend(4, 12)  # request 3 is displaced already: its full block 5, not block 0
    assert decode(t.table(4)[2])[0] == 5
    m.check()


def test_guest_takes_empty_slots_without_checkpoint():
    t = BidirectionalBlocks(range(1), BS, host_slots=8)
    m = SlotModel(t)
    t.add(1, reverse=True)
    m.extend(1, 2)
    t.add(2, reverse=False)
    m.extend(2, 2)
    assert t.checkpointed_slots(1) == 0 and not t.displaced(1)
    assert t.shared_blocks() == 1
    m.extend(2, 3)  # the third RT token lands on BE's second slot
    assert t.checkpointed_slots(1) == 1 and t.checkpointed_blocks(1) == 1
    assert t.checkpointed_slots_total == 1
    m.check()
    t.free(2)
    assert t.can_restore(1) and t.restore_blocks_needed(1) == 0
    c = t.restore(1)
    assert len(c.into) == 1 and not c.move  # in place: exactly the checkpointed slot
    m.apply(c)
    m.check()
    assert not t.displaced(1)


def test_restore_merges_into_a_fresh_block_while_rt_stays():
    t = BidirectionalBlocks(range(2), BS, host_slots=8)
    m = SlotModel(t)
    t.add(1, reverse=True)
    m.extend(1, 4)
    t.add(2, reverse=False)
    t.add(3, reverse=False)
    m.extend(3, 4)  # takes the free block
    m.extend(2, 1)  # must preempt the BE block: checkpoint one slot
    assert t.checkpointed_slots(1) == 1
    t.free(3)
    c = t.restore(1)
    assert len(c.move) == 3 and len(c.into) == 1
    m.apply(c)
    m.check()


def test_be_moves_its_block_away_from_a_guest():
    t = BidirectionalBlocks(range(3), BS, host_slots=8)
    m = SlotModel(t)
    t.add(1, reverse=True)
    m.extend(1, 1)
    t.add(2, reverse=False)
    m.extend(2, 4)  # a free block first (full: no room for a BE guest)
    t.add(3, reverse=False)
    m.extend(3, 4)
    t.add(4, reverse=False)
    m.extend(4, 3)  # no free block left: a guest in BE's block, slots 0..2
    assert decode(t.table(4)[0])[0] == decode(t.table(1)[0])[0]
    assert not t.can_extend(1, 2), "BE's next slot is the guest's and no block has room"
    t.free(2)
    c = t.extend(1, 2)
    assert len(c.move) == 1 and not c.out
    m.apply(c)
    m.device[physical_slot(t.table(1)[0], 1, BS)] = (1, 1)
    m.check()


def test_be_takes_the_emptiest_rt_block_when_none_is_free():
    """The other direction (§5.2 FindBlock, issue 14 item 4): with no block free, a BE request's
    last block goes to the right side of the RT block with the most empty slots; RT growing
    into it checkpoints exactly the guest's slots it overwrites first."""
    t = BidirectionalBlocks(range(3), BS, host_slots=8)
    m = SlotModel(t)
    t.add(1, reverse=False)
    m.extend(1, 5)  # blocks 0 (full) and 1 (one slot: three empty)
    t.add(2, reverse=False)
    m.extend(2, 2)  # block 2 (two empty)
    assert t.num_free == 0 and t.guest_block(1) == 1 and t.guest_block(4) is None
    t.add(3, reverse=True)
    assert not t.can_extend(3, 4), "a whole block needs a free one"
    m.extend(3, 2)  # a guest in block 1, slots 3 and 2
    assert t.table(3) == [encode(1, True)] and t.block(1) == (1, 1, 3, 2, frozenset())
    assert t.guest_blocks_total == 1 and t.shared_blocks() == 1
    m.check()
    assert not t.can_extend(3, 4), "its next slot is RT's and no block has room"
    m.extend(1, 6)  # RT takes the empty slot 1: nothing to checkpoint
    assert t.checkpointed_slots(3) == 0 and not t.displaced(3)
    m.extend(1, 7)  # RT reaches slot 2, the guest's first: checkpointed first
    assert t.checkpointed_slots(3) == 1 and t.displaced(3) and t.block(1)[4] == {2}
    assert t.guest_checkpointed_total == t.checkpointed_slots_total == 1
    m.check()
    t.free(1)  # block 1 is the BE request's alone now: swapped back in place
    assert t.can_restore(3) and t.restore_blocks_needed(3) == 0
    m.apply(t.restore(3))
    m.check()
    m.extend(3, 4)  # and it fills the block from the right
    m.check()


def test_be_prompt_puts_only_its_partial_last_block_in_an_rt_block():
    t = BidirectionalBlocks(range(3), BS, host_slots=8)
    m = SlotModel(t)
    t.add(1, reverse=False)
    m.extend(1, 1)
    t.add(2, reverse=False)
    m.extend(2, 3)  # two free blocks left... one after this
    t.add(3, reverse=True)
    assert not t.can_extend(3, 8), "two whole blocks, one free"
    m.extend(3, 6)  # one free block (full), the last two slots a guest in RT 1's block
    assert t.table(3) == [encode(2, True), encode(0, True)] and t.guest_blocks_total == 1
    m.check()
    m.extend(3, 7)  # still room on the guest's side
    assert not t.can_extend(3, 8), "its last slot is RT's: the block must move, none has room"
    m.check()


def test_grow_is_extend_where_it_can_and_nothing_where_it_cannot():
    """The fit's per-request call, each way it can go: RT filling its own block, reaching a BE
    guest's slots (checkpoints), short of host slots (None), taking a free or a BE block; a BE
    guest whose next slot is RT's with no block to move to, or displaced (None)."""
    t = BidirectionalBlocks(range(3), BS, host_slots=2)
    m = SlotModel(t)
    t.add(1, reverse=False)
    _grow(t, m, 1, 1)  # a fresh block
    _grow(t, m, 1, 2)  # within it
    t.add(2, reverse=True)
    for tokens in (4, 8, 10):  # two free blocks, then a guest in RT 1's block
        _grow(t, m, 2, tokens)
    assert t.guest_blocks_total == 1 and t.num_free == 0
    _grow(t, m, 2, 11)  # its next slot is RT's, and no block is free to move to
    _grow(t, m, 1, 3)  # RT reaches the guest's slots: each checkpointed first
    _grow(t, m, 1, 4)
    assert t.checkpointed_slots(2) == 2 and t.free_host_slots == 0
    _grow(t, m, 2, 11)  # displaced
    _grow(t, m, 1, 5)  # a BE block to preempt, but no host slot to checkpoint into
    assert (t.tokens(1), t.tokens(2)) == (4, 10)
    t.free(2)
    _grow(t, m, 1, 5)  # a free block
    t.add(3, reverse=True)
    _grow(t, m, 3, 4)
    _grow(t, m, 1, 8)  # 3 new tokens, 2 host slots (each might need one): nothing changes
    _grow(t, m, 1, 7)
    _grow(t, m, 1, 8)
    _grow(t, m, 1, 10)  # no free block: the BE one, its first two slots checkpointed
    assert t.checkpointed_slots(3) == 2
    m.check()


def test_refuses_what_it_cannot_do():
    t = BidirectionalBlocks(range(1), BS, host_slots=0)
    t.add(1, reverse=True)
    t.extend(1, 4)
    t.add(2, reverse=False)
    assert not t.can_extend(2, 1), "no host slot to checkpoint into"
    with pytest.raises(BidirectionalError):
        t.extend(2, 1)
    with pytest.raises(BidirectionalError):
        t.add(1, reverse=False)


ops = st.lists(st.tuples(st.sampled_from(["add_rt", "add_be", "grow", "grow", "grow", "free",
                                          "restore", "swap_out", "swap_in"]),
                         st.integers(0, 7), st.integers(1, 6)), max_size=60)


@settings(max_examples=slow_scale(300, 60), deadline=None)
@given(blocks=st.integers(1, 8), host=st.integers(0, 24), program=ops,
       rt_first=st.booleans())
def test_random_use_keeps_every_slot_owned_once_and_nothing_lost(blocks, host, program, rt_first):
    t = BidirectionalBlocks(range(blocks), BS, host_slots=host)
    m = SlotModel(t)
    if rt_first:  # RT KV in every block first, partly filled: BE requests become its guests
        for b in range(blocks):
            t.add(b, reverse=False)
            if t.can_extend(b, 1 + b % (BS - 1)):  # RT growth needs host slots in reserve
                m.extend(b, 1 + b % (BS - 1))
        for rid in (blocks, blocks + 1):
            t.add(rid, reverse=True)
            if t.can_extend(rid, 1):
                m.extend(rid, 1)
    else:  # BE KV in every block first, so RT growth must preempt it
        t.add(0, reverse=True)
        m.extend(0, blocks * BS - 1)
    _play(t, m, program, next_id=blocks + 2)
    for rid in t.requests():
        t.free(rid)
    assert t.num_free == blocks and t.free_host_slots == host, "nothing leaks on free"


guest_ops = st.lists(st.tuples(st.sampled_from(["grow", "grow", "grow_be", "grow_be", "add_be",
                                                "free_rt", "restore_be", "restore_be"]),
                               st.integers(0, 7), st.integers(1, 3)), max_size=40)


@settings(max_examples=slow_scale(400, 100), deadline=None)
@given(blocks=st.integers(2, 6), spare=st.integers(0, 2), program=guest_ops)
def test_be_guests_in_rt_blocks_keep_every_slot_owned_once(blocks, spare, program):
    """The other direction under short, decode-like growth: BE guests in RT blocks, RT reaching
    their slots (each checkpointed first), guests moving away and swapping back."""
    total, host = blocks + spare, 4 * (blocks + spare) * BS
    t = BidirectionalBlocks(range(total), BS, host_slots=host)
    m = SlotModel(t)
    for b in range(blocks):  # an RT request in most blocks, partly filled
        t.add(b, reverse=False)
        m.extend(b, 1 + b % (BS - 1))
    for rid in (blocks, blocks + 1):  # BE requests in the spare blocks, then as guests
        t.add(rid, reverse=True)
        if (tokens := next((n for n in (BS + 1, 1) if t.can_extend(rid, n)), 0)):
            m.extend(rid, tokens)
    _play(t, m, program, next_id=blocks + 2)
    for rid in t.requests():
        t.free(rid)
    assert t.num_free == total and t.free_host_slots == host, "nothing leaks on free"


def _state(t: BidirectionalBlocks) -> tuple:
    return ([t.block(b) for b in range(t.num_total)], t.num_free, t.free_host_slots,
            {r: (t.table(r), t.tokens(r), t.host_slots(r)) for r in t.requests()})


def _grow(t: BidirectionalBlocks, m: SlotModel, rid: int, tokens: int) -> None:
    """`grow` (the fit's call, a fast path where the blocks already hold `tokens`) against
    `can_extend` then `extend` on a copy: the same copies and the same table, or None and no
    change."""
    twin = copy.deepcopy(t)
    if not twin.can_extend(rid, tokens):
        before = _state(t)
        assert t.grow(rid, tokens) is None and _state(t) == before, "grow changed the table"
        return
    expected = twin.extend(rid, tokens, checked=True)
    m.extend(rid, tokens, grow=True)
    assert m.last == expected and _state(t) == _state(twin), "grow is not extend"


def _play(t: BidirectionalBlocks, m: SlotModel, program, next_id: int) -> None:
    """Run the program's operations that the table allows, checking every invariant after each."""
    for op, pick, n in program:
        live = t.requests()
        if op in ("grow_be", "restore_be", "free_rt"):  # one class's requests only
            op, live = op[:-3], [i for i in live if t.is_reversed(i) == op.endswith("_be")]
        rid = live[pick % len(live)] if live else None
        if op in ("add_rt", "add_be"):
            t.add(next_id, reverse=op == "add_be")
            next_id += 1
        elif rid is None:
            continue
        elif op == "grow" and pick % 2:
            _grow(t, m, rid, t.tokens(rid) + n)
        elif op == "grow" and t.can_extend(rid, t.tokens(rid) + n):
            m.extend(rid, t.tokens(rid) + n)
        elif op == "free":
            t.free(rid)
        elif op == "restore" and t.can_restore(rid):
            m.apply(t.restore(rid))
        elif op == "swap_out" and t.can_swap_out(rid):
            m.apply(t.swap_out(rid))
        elif op == "swap_in" and t.can_swap_in(rid):
            m.apply(t.swap_in(rid))
        m.check()
