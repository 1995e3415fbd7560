"""The torch attention paths against a naive dense attention, in float64, per sequence and head.

Every other attention implementation is checked against these paths, so they are checked here
against the definition: softmax(q k^T * scale + causal mask) v over each sequence's whole context.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu.attention import (
    decode_attention_torch,
    paged_attention,
    plan_decode,
    prefill_attention_torch,
    write_kv,
)
from tests.gpu.paged_batch import PagedBatch, make_paged_batch

SCALE = 0.125


def naive_attention(batch: PagedBatch, scale: float = SCALE) -> torch.Tensor:
    """Dense causal attention from each sequence's own K/V: [T, Hq, D], in float64."""
    meta, q = batch.meta, batch.q.double()
    group = q.shape[1] // batch.keys[0].shape[1]
    out = torch.empty_like(q)
    start = 0
    for keys, values, ql, sl in zip(batch.keys, batch.values, meta.query_lens_host,
                                    meta.seq_lens_host):
        for r in range(ql):
            visible = sl - ql + r + 1  # query r sits at position sl - ql + r
            for h in range(q.shape[1]):
                k = keys[:visible, h // group].double()  # [visible, D]
                v = values[:visible, h // group].double()
                weights = torch.softmax(k @ q[start + r, h] * scale, dim=0)  # [visible]
                out[start + r, h] = weights @ v
        start += ql
    return out


def decode_args(batch: PagedBatch) -> tuple:
    meta = batch.meta
    return (batch.q, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens,
            meta.max_seq_len, SCALE)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (8, 2)])
def test_prefill_matches_naive(block_size: int, num_q_heads: int, num_kv_heads: int) -> None:
    # a fresh prompt, one with a cached prefix ending mid-block, and a one-token chunk
    batch = make_paged_batch(prefills=[(21, 21), (13, 50), (1, 34)], num_q_heads=num_q_heads,
                             num_kv_heads=num_kv_heads, block_size=block_size, seed=1)
    out = prefill_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.meta, SCALE)
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


def test_prefill_with_the_steps_own_keys_matches_naive() -> None:
    # fresh prompts take their keys and values from the step, not the cache; the chunk with a
    # cached prefix still reads the cache. Poison the fresh prompts' cache slots to prove it.
    batch = make_paged_batch(prefills=[(21, 21), (13, 50), (30, 30)], num_q_heads=6,
                             num_kv_heads=2, block_size=16, seed=5)
    meta = batch.meta
    k_new = torch.cat([keys[sl - ql:sl] for keys, ql, sl in
                       zip(batch.keys, meta.query_lens_host, meta.seq_lens_host)])
    v_new = torch.cat([values[sl - ql:sl] for values, ql, sl in
                       zip(batch.values, meta.query_lens_host, meta.seq_lens_host)])
    expected = naive_attention(batch)
    for i in (0, 2):
        used = meta.block_tables[i, :-(-meta.seq_lens_host[i] // 16)].long()
        batch.k_cache[used] = float("nan")
        batch.v_cache[used] = float("nan")
    out = prefill_attention_torch(batch.q, batch.k_cache, batch.v_cache, meta, SCALE,
                                  k_new, v_new)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 1)])
def test_decode_matches_naive(block_size: int, num_q_heads: int, num_kv_heads: int) -> None:
    batch = make_paged_batch(decode_lens=[1, 17, 64, 5], num_q_heads=num_q_heads,
                             num_kv_heads=num_kv_heads, block_size=block_size, seed=2)
    out = decode_attention_torch(*decode_args(batch))
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


def test_mixed_step_matches_naive() -> None:
    batch = make_paged_batch(prefills=[(9, 9), (7, 40)], decode_lens=[3, 33, 16],
                             num_q_heads=6, num_kv_heads=2, head_dim=16, seed=3)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, SCALE,
                          backend="torch")
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


def test_decode_ignores_padding_slots_and_table_entries() -> None:
    # the batch poisons every slot it does not own with NaN and pads tables past the arena;
    # make the padding a valid block full of huge values too, which a leaky mask would pick up
    batch = make_paged_batch(decode_lens=[5, 40], seed=4)
    batch.meta.block_tables[0, 1:] = batch.meta.block_tables[1, 0]
    batch.k_cache[batch.meta.block_tables[0, 0].long(), 5:] = 1e4
    out = decode_attention_torch(*decode_args(batch))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


def test_decode_keeps_a_bad_value_in_a_sequences_own_slot_visible() -> None:
    # only the slots outside a sequence are cleaned: NaN in one of its own tokens (a missed
    # copy, a bad swap-in) must still reach its output, not be zeroed away
    batch = make_paged_batch(decode_lens=[5, 40], seed=4)
    batch.v_cache[batch.meta.block_tables[1, 1].long(), 3] = float("nan")  # token 19 of row 1
    out = decode_attention_torch(*decode_args(batch))
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=40),
       block_size=st.sampled_from([4, 16]), bucket=st.integers(1, 17), seed=st.integers(0, 99),
       reversed_share=st.sampled_from([0.0, 0.5]))
def test_decode_plan_reads_only_each_sequences_own_blocks_and_unmasks_exactly_its_tokens(
        lens: list[int], block_size: int, bucket: int, seed: int, reversed_share: float) -> None:
    # tables padded with blocks of other sequences, some entries reversed (-b-1: filled right to
    # left): a plan that read a table entry past a sequence's blocks would name a block it does
    # not own, and one that got a reversed block's slots backwards would unmask the wrong ones
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens) + 2
    tables = torch.randperm(len(lens) * width, generator=gen).view(len(lens), width)
    flip = torch.rand(tables.shape, generator=gen) < reversed_share
    tables = torch.where(flip, -tables - 1, tables)
    plan = plan_decode(tables.int(), lens, block_size, bucket=bucket)
    seen = []
    for g in plan.groups:
        b = g.rows.shape[0]
        assert b <= bucket
        blocks = g.blocks.view(b, -1)
        valid = g.valid.view(b, blocks.shape[1], block_size)
        for i, row in enumerate(g.rows.tolist()):
            n = lens[row]
            entries = tables[row, :-(-n // block_size)].tolist()
            assert set(blocks[i].tolist()) <= {-e - 1 if e < 0 else e for e in entries}
            want = set()
            for p in range(n):
                e, o = int(tables[row, p // block_size]), p % block_size
                want.add((-e - 1, block_size - 1 - o) if e < 0 else (e, o))
            got = {(int(blocks[i, j]), o) for j, o in valid[i].nonzero().tolist()}
            assert got == want and int(valid[i].sum()) == n
            seen.append(row)
        assert g.stale.tolist() == (~g.valid.reshape(-1)).nonzero().flatten().tolist()
    assert sorted(seen) == list(range(len(lens)))


def test_write_kv_stores_each_token_at_its_slot() -> None:
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros(4, 16, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv(k_cache, v_cache, k, v, torch.tensor([3 * 16 + 15, 0, 16 + 1]))
    torch.testing.assert_close(k_cache[3, 15], k[0])
    torch.testing.assert_close(v_cache[0, 0], v[1])
    torch.testing.assert_close(k_cache[1, 1], k[2])
    assert k_cache.count_nonzero() == 3 * 2 * 8
