"""Attention over bidirectional blocks (BROS §5.1): sequences written right to left (negative
block table entries) sharing blocks with sequences written left to right. The torch path is
checked against dense attention from each sequence's own keys, and both Triton kernels against
the torch path (TRITON_INTERPRET=1 without CUDA); every slot outside each sequence is NaN, so a
slot read in the wrong direction shows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.attention import decode_attention_torch, prefill_attention_torch, write_kv
from gpu.metadata import build_metadata, physical_slots

BS, HQ, HKV, D = 16, 4, 2, 16
SCALE = 0.25

# (block table, sequence length): A and B share block 1 (A 4 slots from the left, B 10 from the
# right); C and D share block 3 exactly (7 + 9 slots); E is reversed on its own over three blocks
SEQS = {
    "A": ([0, 1], 20),
    "B": ([-3, -2], 26),
    "C": ([-4], 7),
    "D": ([3], 9),
    "E": ([-5, -6, -7], 40),
}


def _arena(seed: int):
    gen = torch.Generator().manual_seed(seed)
    arena = torch.full((8, 2, 2, BS, HKV, D), float("nan"))  # [blocks, layers, k/v, slot, H, D]
    k_cache, v_cache = arena[:, 1, 0], arena[:, 1, 1]
    keys, values = {}, {}
    for name, (table, length) in SEQS.items():
        k = torch.randn(length, HKV, D, generator=gen)
        v = torch.randn(length, HKV, D, generator=gen)
        slots = physical_slots(np.arange(length), np.asarray(table), BS)
        write_kv(k_cache, v_cache, k, v, torch.from_numpy(slots))
        keys[name], values[name] = k, v
    return arena, k_cache, v_cache, keys, values, gen


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """q: [L, Hq, D] at positions first_pos.. over k, v: [S, Hkv, D], causal -> [L, Hq, D]."""
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        seen = first_pos + r + 1
        for h in range(HQ):
            w = torch.softmax(k[:seen, h // (HQ // HKV)] @ q[r, h] * SCALE, dim=0)
            out[r, h] = w @ v[:seen, h // (HQ // HKV)]
    return out


def test_shared_blocks_hold_both_sequences_without_overlap():
    used = [set(physical_slots(np.arange(n), np.asarray(t), BS)) for t, n in SEQS.values()]
    assert sum(len(u) for u in used) == len(set().union(*used))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_reads_reversed_slots(backend: str):
    arena, k_cache, v_cache, keys, values, gen = _arena(1)
    meta = build_metadata([([0], n - 1, t) for t, n in SEQS.values()], BS, "cpu")
    q = torch.randn(len(SEQS), HQ, D, generator=gen)
    expected = torch.stack([_dense(q[i:i + 1], keys[s], values[s], n - 1)[0]
                            for i, (s, (_, n)) in enumerate(SEQS.items())])
    torch_out = decode_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.max_seq_len, SCALE)
    torch.testing.assert_close(torch_out, expected, atol=1e-5, rtol=1e-5)
    if backend == "triton":
        from gpu.kernels import DecodeTiles, decode_attention_triton

        out = decode_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      meta.max_seq_len, SCALE, tiles=DecodeTiles(block_n=16))
        torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_reads_reversed_slots(backend: str):
    arena, k_cache, v_cache, keys, values, gen = _arena(2)
    chunks = {"A": 5, "B": 26, "C": 3, "E": 17}  # query tokens at the end of each sequence
    meta = build_metadata([([0] * ql, SEQS[s][1] - ql, SEQS[s][0]) for s, ql in chunks.items()],
                          BS, "cpu", num_prefills=len(chunks))
    q = torch.randn(sum(chunks.values()), HQ, D, generator=gen)
    parts, start = [], 0
    for s, ql in chunks.items():
        parts.append(_dense(q[start:start + ql], keys[s], values[s], SEQS[s][1] - ql))
        start += ql
    expected = torch.cat(parts)
    torch_out = prefill_attention_torch(q, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(torch_out, expected, atol=1e-5, rtol=1e-5)
    if backend == "triton":
        from gpu.kernels import PrefillTiles, prefill_attention_triton

        out = prefill_attention_triton(q, k_cache, v_cache, meta, SCALE,
                                       tiles=PrefillTiles(block_m=16, block_n=16))
        torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)
    assert torch.isnan(arena[:, 0]).all(), "attention wrote into the cache"
