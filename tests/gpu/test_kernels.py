"""The Triton attention kernels against the torch paths (themselves checked against a naive
attention in test_attention_reference.py), on fresh random paged batches.

Without CUDA these run under TRITON_INTERPRET=1 (tests/conftest.py), which is slow: shapes stay
small, and the long cases are `slow` with a short form by default.

Tolerances (atol = rtol). fp32, 1e-5: both sides accumulate in fp32 and differ only in summation
order and exp2 vs exp; outputs are convex combinations of N(0, 1) values (|out| < 4) and differ by
at most 1.5e-6 over these cases (~6 ulp); a masking, scaling or indexing error moves them by
~1e-1. fp16, 2e-3: the torch path runs in fp32 on the same fp16-rounded inputs, while the kernel
rounds its softmax weights to fp16 before P @ V (FlashAttention's choice) and its output to fp16,
half an ulp each: up to 1e-3 at |out| ~ 3, measured <= 1.0e-3; rtol carries the larger outputs.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from gpu.attention import decode_attention_torch, paged_attention, prefill_attention_torch
from gpu.kernels import (
    DecodeTiles,
    PrefillTiles,
    decode_attention_triton,
    prefill_attention_triton,
)
from tests.conftest import slow_scale
from tests.gpu.paged_batch import PagedBatch, make_paged_batch

SCALE = 0.17
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@attrs.frozen(kw_only=True)
class Case:
    """A batch shape; `lens` are (query_len, seq_len) for prefills, seq_len for decodes."""

    lens: tuple
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 16
    tiles: PrefillTiles | DecodeTiles | None = None


def hash_seed(name: str) -> int:
    """A seed per case that does not depend on PYTHONHASHSEED."""
    return sum(ord(c) * 31**i for i, c in enumerate(name)) % 2**31


def _batch(case: Case, dtype: torch.dtype, seed: int, *, prefill: bool) -> PagedBatch:
    lens = {"prefills": case.lens} if prefill else {"decode_lens": case.lens}
    return make_paged_batch(**lens, num_q_heads=case.num_q_heads,
                            num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                            block_size=case.block_size, dtype=dtype, seed=seed)


def _check_prefill(case: Case, dtype: torch.dtype, seed: int) -> None:
    batch = _batch(case, dtype, seed, prefill=True)
    out = prefill_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, SCALE,
                                   tiles=case.tiles)
    expected = prefill_attention_torch(batch.q.float(), batch.k_cache.float(),
                                       batch.v_cache.float(), batch.meta, SCALE)
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def _check_decode(case: Case, dtype: torch.dtype, seed: int) -> None:
    batch = _batch(case, dtype, seed, prefill=False)
    meta = batch.meta
    out = decode_attention_triton(batch.q, batch.k_cache, batch.v_cache, meta.block_tables,
                                  meta.seq_lens, meta.max_seq_len, SCALE, tiles=case.tiles)
    expected = decode_attention_torch(batch.q.float(), batch.k_cache.float(),
                                      batch.v_cache.float(), meta.block_tables, meta.seq_lens,
                                      meta.max_seq_len, SCALE)
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


PREFILL_CASES = {
    # a fresh prompt, a one-token prompt, a chunk after a prefix ending mid-block
    "mha-d16": Case(lens=((21, 21), (1, 1), (5, 38)), num_q_heads=2, head_dim=16),
    "g2-d32-prefix": Case(lens=((13, 50), (1, 34))),
    "g4-d64-bs32": Case(lens=((33, 33), (7, 70)), num_q_heads=4, num_kv_heads=1, head_dim=64,
                        block_size=32),
    "g8-d128": Case(lens=((17, 17), (3, 45)), num_q_heads=8, num_kv_heads=1, head_dim=128),
    "g3-d80": Case(lens=((9, 40),), num_q_heads=6, num_kv_heads=2, head_dim=80),
    # key tiles smaller than a cache block, several query tiles, both key loops
    "tiles16-bs32": Case(lens=((40, 75),), block_size=32,
                         tiles=PrefillTiles(block_m=16, block_n=16)),
    # key tiles spanning four cache blocks, one query tile holding two sequences' worth of rows
    "tiles64-bs16": Case(lens=((30, 97), (2, 2)), num_q_heads=2, num_kv_heads=1,
                         tiles=PrefillTiles(block_m=64, block_n=64)),
}

DECODE_CASES = {
    "mha-d16": Case(lens=(1, 16, 17), num_q_heads=2, head_dim=16),
    "g2-d32": Case(lens=(5, 33, 64, 1)),
    "g4-d64-bs32": Case(lens=(31, 32, 100), num_q_heads=8, num_kv_heads=2, head_dim=64,
                        block_size=32),
    "g8-d128": Case(lens=(1, 77), num_q_heads=8, num_kv_heads=1, head_dim=128),
    "g3-d80": Case(lens=(9, 40), num_q_heads=6, num_kv_heads=2, head_dim=80),
    "tiles16-bs32": Case(lens=(70, 3), block_size=32, tiles=DecodeTiles(block_n=16)),
    # flash-decoding: splits shorter than a block, empty splits past short sequences' ends
    "split3-tiles16": Case(lens=(1, 70, 200, 33), tiles=DecodeTiles(block_n=16, num_splits=3)),
    "split4-g8-d128": Case(lens=(5, 300), num_q_heads=8, num_kv_heads=1, head_dim=128,
                           tiles=DecodeTiles(num_splits=4)),
}


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_fp32(name: str) -> None:
    _check_prefill(PREFILL_CASES[name], torch.float32, seed=hash_seed(name))


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_fp32(name: str) -> None:
    _check_decode(DECODE_CASES[name], torch.float32, seed=hash_seed(name))


@pytest.mark.parametrize("name", ["g2-d32-prefix", "g8-d128"])
def test_prefill_fp16(name: str) -> None:
    _check_prefill(PREFILL_CASES[name], torch.float16, seed=hash_seed(name) + 1)


@pytest.mark.parametrize("name", ["g2-d32", "g8-d128"])
def test_decode_fp16(name: str) -> None:
    _check_decode(DECODE_CASES[name], torch.float16, seed=hash_seed(name) + 1)


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_one_long_sequence_among_short_ones(num_splits: int) -> None:
    case = Case(lens=(slow_scale(8000, 900), 1, 2, 17, 31), num_q_heads=8, num_kv_heads=2,
                head_dim=64, tiles=DecodeTiles(num_splits=num_splits))
    _check_decode(case, torch.float32, seed=11)


@pytest.mark.slow
def test_prefill_long_chunk_after_long_prefix_among_short_ones() -> None:
    query_len = slow_scale(512, 64)
    case = Case(lens=((query_len, slow_scale(2048, 200)), (1, 1), (3, 19)), num_q_heads=2,
                num_kv_heads=1, head_dim=64)
    _check_prefill(case, torch.float32, seed=12)


def test_paged_attention_triton_matches_torch() -> None:
    # a big arena: block ids past 1000, as arena-global ids behind the weights are
    batch = make_paged_batch(prefills=[(9, 9), (7, 40)], decode_lens=[3, 33, 1], num_q_heads=8,
                             num_kv_heads=2, head_dim=32, block_size=16, arena_blocks=1500,
                             seed=13)
    assert batch.meta.block_tables[batch.meta.block_tables < 1500].max() > 1000
    args = (batch.q, batch.k_cache, batch.v_cache, batch.meta, SCALE)
    out = paged_attention(*args, backend="triton")
    torch.testing.assert_close(out, paged_attention(*args, backend="torch"),
                               atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


def test_kernels_leave_the_arena_alone() -> None:
    batch = make_paged_batch(prefills=[(5, 20)], decode_lens=[7], seed=14)
    before = batch.arena.clone()
    paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, SCALE, backend="triton")
    torch.testing.assert_close(batch.arena, before, equal_nan=True, atol=0, rtol=0)
