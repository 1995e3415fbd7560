"""The gather kind of BROS's slot copies (gpu/slot_copy.py): a step's slots, across blocks, in
one indexed copy, against a reference that copies slot by slot in the given order. Every slot
the copies do not write must keep what it held."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.memory.slot_runs import slot_runs
from gpu.slot_copy import copy_slots

BS = 4
BLOCKS = 6


def _arenas(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    device = torch.randn(BLOCKS, 2, 2, BS, 2, 3, generator=gen)  # [blocks, L, k/v, slot, H, D]
    host = torch.randn(BLOCKS, 2, 2, BS, 2, 3, generator=gen) + 100.0
    return device, host


def _reference(direction: str, pairs: list[tuple[int, int]], device: torch.Tensor,
               host: torch.Tensor) -> None:
    src, dst = {"out": (device, host), "in": (host, device), "move": (device, device)}[direction]
    for s, d in pairs:  # one slot at a time, in order
        dst[d // BS, :, :, d % BS] = src[s // BS, :, :, s % BS]


def _differing(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    """Flat slots (block * BS + offset) whose KV differs."""
    diff = (got != want).flatten(start_dim=4).any(dim=-1).any(dim=1).any(dim=1)  # [blocks, BS]
    return [int(i) for i in diff.flatten().nonzero().flatten()]


@st.composite
def slot_copies(draw: st.DrawFn) -> tuple[str, list[tuple[int, int]]]:
    """A direction and pairs with distinct destinations, some in whole aligned blocks (a block
    group) and some single slots scattered across blocks; a move's sources and destinations
    drawn from disjoint halves of the arena, as the table makes them."""
    direction = draw(st.sampled_from(["out", "in", "move"]))
    slots = BLOCKS * BS
    if direction == "move":
        src_pool, dst_pool = list(range(slots // 2)), list(range(slots // 2, slots))
    else:
        src_pool = dst_pool = list(range(slots))
    dst = draw(st.lists(st.sampled_from(dst_pool), min_size=1, max_size=len(dst_pool),
                        unique=True))
    src = draw(st.lists(st.sampled_from(src_pool), min_size=len(dst), max_size=len(dst)))
    pairs = list(zip(src, dst))
    if direction != "move" and draw(st.booleans()):  # a block group of two blocks first
        taken = {d for _, d in pairs}
        free = [b for b in range(BLOCKS - 1)
                if not taken & set(range(b * BS, (b + 2) * BS))]
        if free:
            b = draw(st.sampled_from(free))
            a = draw(st.integers(0, BLOCKS - 2))
            pairs = [(a * BS + i, b * BS + i) for i in range(2 * BS)] + pairs
    return direction, pairs


@settings(max_examples=150, deadline=None)
@given(copies=slot_copies(), seed=st.integers(0, 3))
def test_a_gather_copies_exactly_what_slot_by_slot_copies_do(copies, seed):
    direction, pairs = copies
    device, host = _arenas(seed)
    want_device, want_host = device.clone(), host.clone()
    _reference(direction, pairs, want_device, want_host)
    calls, nbytes = copy_slots(direction, pairs, device, host)
    assert _differing(device, want_device) == [], "device slots differ from slot-by-slot copies"
    assert _differing(host, want_host) == [], "host slots differ from slot-by-slot copies"
    assert nbytes == len(pairs) * 2 * 2 * 2 * 3 * 4
    runs = slot_runs(pairs, BS)
    groups = sum(1 for _, _, n in runs if n > BS)
    assert calls == groups + (len(runs) > groups), "one call a block group, one for the rest"


def test_one_step_of_checkpoints_across_blocks_is_one_call():
    """RT's decode overwrites one BE slot in each of five blocks: five runs, one gather."""
    device, host = _arenas(0)
    pairs = [(b * BS + 1, 3 * b) for b in range(5)]
    want_device, want_host = device.clone(), host.clone()
    _reference("out", pairs, want_device, want_host)
    assert copy_slots("out", pairs, device, host)[0] == 1
    assert _differing(host, want_host) == [] and _differing(device, want_device) == []
    back = [(h, d) for d, h in pairs]  # and back, into the device slots they left
    device[:5, :, :, 1] = 0.0
    assert copy_slots("in", back, device, host)[0] == 1
    assert _differing(device, want_device) == []
    assert copy_slots("in", back, device, host, gather=False)[0] == 5


def test_a_move_onto_its_own_sources_keeps_the_given_order():
    """(0 -> 1, 1 -> 2) copied in order leaves slot 0's KV in 1 and 2; a gather would read slot
    1 before writing it."""
    device, host = _arenas(1)
    pairs = [(1, 2), (0, 1), (4, 9)]
    want_device = device.clone()
    _reference("move", pairs, want_device, host.clone())
    copy_slots("move", pairs, device, host)
    assert _differing(device, want_device) == []
