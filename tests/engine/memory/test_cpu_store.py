"""CPU copy store (FastSwitch §3.3): increments only, contamination, and a model check that a
stale block is never reused."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.memory.cpu_store import CpuCopyStore
from tests.conftest import slow_scale

BS = 4


def test_second_swap_out_copies_only_the_increment():
    store = CpuCopyStore(range(100), BS)
    first = store.prepare_swap_out("a", 10, rank=0)
    assert (first.first_block, len(first.cpu_blocks), first.reused_blocks) == (0, 3, 0)
    store.mark_backup("a", rank=0)            # swapped back in; the copy stays as a backup
    second = store.prepare_swap_out("a", 22, rank=0)
    # blocks 0 and 1 are full and valid; block 2 held tokens 8..9 only, so it is copied again
    assert (second.first_block, len(second.cpu_blocks), second.reused_blocks) == (2, 4, 2)
    assert store.blocks("a")[:3] == list(first.cpu_blocks)


def test_a_more_deserving_request_contaminates_a_backup_from_its_tail():
    store = CpuCopyStore(range(10), BS, expected_group=1)
    store.prepare_swap_out("low", 32, rank=5)   # 8 blocks
    store.mark_backup("low", rank=5)
    plan = store.prepare_swap_out("high", 20, rank=1)  # 5 blocks: 2 free + 3 taken from "low"
    assert plan is not None and len(plan.cpu_blocks) == 5
    low = store.get("low")
    assert low.contaminated and low.valid_tokens == 5 * BS
    assert store.contaminations == 1


def test_sole_copies_and_more_deserving_backups_are_never_taken():
    store = CpuCopyStore(range(10), BS, expected_group=1)
    store.prepare_swap_out("swapped", 24, rank=9)        # sole: its request is swapped out
    store.prepare_swap_out("better", 12, rank=0)
    store.mark_backup("better", rank=0)
    assert store.prepare_swap_out("new", 8, rank=3) is None
    assert store.get("better").valid_tokens == 12 and not store.get("better").contaminated
    assert store.get("new") is None and store.num_free == 1


OPS = ("out", "out", "in", "in", "grow", "grow", "drop")


def decode_ops(raw: bytes) -> list[tuple[str, str, int, int]]:
    """Two bytes an operation: (op, request) from the first, (tokens 1..16, rank 0..5) from the
    second. Hypothesis draws a byte string some 15 times faster than a list of tuples of
    sampled values (and shrinks it as well), so the same seconds buy more, longer sequences."""
    return [(OPS[a % 7], "abcd"[a // 7 % 4], 1 + b % 16, b // 16 % 6)
            for a, b in zip(raw[::2], raw[1::2])]


ops = st.binary(min_size=2 * 30, max_size=2 * 120).map(decode_ops)


@settings(max_examples=slow_scale(5000, 1000), deadline=None)
@given(ops)
def test_contamination_never_lets_a_stale_block_be_reused(seq):
    """Model: each owner's device KV has a version per block index (bumped when tokens land in a
    block); a swap-out writes (owner, index, version) tags into CPU blocks. Whatever a copy claims
    valid must carry the owner's current tags."""
    store = CpuCopyStore(range(10), BS, expected_group=2)
    tokens: dict[str, int] = {}
    version: dict[tuple[str, int], int] = {}
    cpu: dict[int, tuple[str, int, int]] = {}
    on_device: set[str] = set()
    for op, key, n, rank in seq:
        if op == "grow" and key in on_device:  # the request computes n more tokens on the device
            old = tokens[key]
            tokens[key] = old + n
            for idx in range(old // BS, -(-tokens[key] // BS)):
                version[(key, idx)] = version.get((key, idx), 0) + 1
        elif op == "out" and key in on_device:
            plan = store.prepare_swap_out(key, tokens[key], rank=rank)
            if plan is not None:
                for i, blk in enumerate(plan.cpu_blocks, start=plan.first_block):
                    cpu[blk] = (key, i, version[(key, i)])
                on_device.discard(key)
        elif op == "in" and store.get(key) is not None and store.get(key).sole:
            store.mark_backup(key, rank=rank)
            on_device.add(key)
        elif op == "in" and key not in on_device and store.get(key) is None:
            tokens[key] = 0  # a new request starts on the device
            on_device.add(key)
        elif op == "drop" and key not in on_device:
            store.drop(key)
            tokens.pop(key, None)
        for k in store.keys():
            blocks = store.blocks(k)
            for idx in range(store.valid_blocks(k)):
                assert cpu.get(blocks[idx]) == (k, idx, version[(k, idx)]), f"{k} block {idx} is stale"
            if store.get(k).sole:
                assert store.get(k).valid_tokens == tokens[k]
