"""One step's slot copies batched by direction (engine/memory/slot_batches.py): run batch by batch
with a gather's semantics (all of a batch's reads before its writes), they must leave every
device and host slot as the copies run one by one in the given order do."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.memory.slot_batches import StepCopies
from engine.memory.slot_runs import SlotCopies

SLOTS = 8


def _run_in_order(changes: list[tuple[int, SlotCopies]]) -> dict[tuple[str, int], object]:
    mem = _fresh()
    for _, c in changes:
        for direction, pairs in (("out", c.out), ("move", c.move), ("in", c.into)):
            for s, d in pairs:
                src, dst = _spaces(direction)
                mem[dst, d] = mem[src, s]
    return mem


def _run_batches(batches: StepCopies) -> dict[tuple[str, int], object]:
    mem = _fresh()
    for _, direction, pairs in batches:
        src, dst = _spaces(direction)
        read = [mem[src, s] for s, _ in pairs]  # a gather: every read first
        for (_, d), value in zip(pairs, read):
            mem[dst, d] = value
    return mem


def _fresh() -> dict[tuple[str, int], object]:
    return {(space, i): (space, i) for space in ("dev", "host") for i in range(SLOTS)}


def _spaces(direction: str) -> tuple[str, str]:
    return {"out": ("dev", "host"), "in": ("host", "dev"), "move": ("dev", "dev")}[direction]


pairs = st.lists(st.tuples(st.integers(0, SLOTS - 1), st.integers(0, SLOTS - 1)), max_size=3,
                 unique_by=lambda p: p[1])
changes = st.lists(st.tuples(st.integers(0, 5), st.builds(
    SlotCopies, out=pairs.map(tuple), move=pairs.filter(
        lambda ps: not {s for s, _ in ps} & {d for _, d in ps}).map(tuple),
    into=pairs.map(tuple))), max_size=8)


@settings(max_examples=300, deadline=None)
@given(changes=changes)
def test_batches_leave_every_slot_as_the_given_order(changes):
    batches = StepCopies()
    for rid, c in changes:
        batches.add(rid, c)
    assert _run_batches(batches) == _run_in_order(changes)
    given_order = sum(bool(p) for _, c in changes for p in (c.out, c.move, c.into))
    assert len(batches) <= given_order


def test_a_step_of_checkpoints_and_restores_is_one_batch_a_direction():
    """Three RT requests overwrite BE slots in three blocks (16 slots a block); two displaced
    BE requests swap theirs back, merged with their surviving slots into fresh blocks."""
    batches = StepCopies()
    for rid, block, host in ((1, 2, 0), (2, 5, 16), (3, 7, 32)):
        batches.add(rid, SlotCopies(out=((block * 16 + 3, host),)))
    batches.add(10, SlotCopies(move=((64 + 15, 144 + 15),), into=((40, 144 + 14),)))
    batches.add(11, SlotCopies(move=((96 + 15, 160 + 15),), into=((48, 160 + 14),)))
    assert [(rid, d, len(p)) for rid, d, p in batches] == [
        (1, "out", 3), (10, "move", 2), (10, "in", 2)]
    plain = StepCopies(merge=False)
    plain.add(1, SlotCopies(out=((35, 0),)))
    plain.add(2, SlotCopies(out=((83, 16),)))
    assert len(plain) == 2


def test_a_host_slot_given_back_and_taken_again_keeps_its_order():
    """A restore reads host slot 4 back; a later checkpoint in the same step takes slot 4 again:
    that checkpoint cannot join the step's earlier checkpoints, which run before the restore."""
    batches = StepCopies()
    batches.add(1, SlotCopies(out=((3, 0),)))
    batches.add(2, SlotCopies(into=((4, 20),)))
    batches.add(3, SlotCopies(out=((35, 4),)))
    batches.add(4, SlotCopies(out=((51, 5),)))
    assert [(d, p) for _, d, p in batches] == [
        ("out", ((3, 0),)), ("in", ((4, 20),)), ("out", ((35, 4), (51, 5)))]
