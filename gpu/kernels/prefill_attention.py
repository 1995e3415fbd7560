"""Prefill attention over a paged KV cache: causal attention of each prefill chunk over its cached
prefix and its own new tokens, all read from the cache through the block table.

One program per (tile of BLOCK_M queries, query head, sequence) runs FlashAttention's online
softmax over the keys up to its causal limit (lightllm's context_attention_fwd, made paged).
Key tiles wholly below the tile's first query are visible to every row and skip the causal mask;
tiles wholly above its last query are never loaded (FlashAttention-2 §3.1.1's causal skipping).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from gpu.kernels.tiles import LOG2E, dot_precision, load_kv_tile, online_softmax_step
from gpu.metadata import AttentionMetadata


@attrs.frozen(kw_only=True)
class PrefillTiles:
    """Launch shape of the prefill kernel."""

    block_m: int = 64
    """Queries per program; a power of two >= 16."""
    block_n: int = 64
    """Keys per loop iteration; a power of two >= 16, independent of the cache block size."""
    num_warps: int = 4
    num_stages: int = 2


def prefill_tiles(head_dim: int, dtype: torch.dtype) -> PrefillTiles:
    """A fixed heuristic: the largest tiles that ptxas fits in registers for sm_90 (triton 3.9)
    without spilling; fp32 (a checking dtype, not a serving one) spills a little at D = 128."""
    if dtype == torch.float32:
        if head_dim <= 64:
            return PrefillTiles(block_m=32, block_n=16, num_warps=4)
        return PrefillTiles(block_m=32, block_n=32, num_warps=8)
    if head_dim <= 64:
        return PrefillTiles(block_m=128, block_n=64, num_warps=8)
    return PrefillTiles(block_m=64, block_n=64, num_warps=8)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, query_start_ptr, seq_lens_ptr, scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_tb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # the last query tiles see the most keys: give them the lowest program ids so they start first
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # query row r sits at KV position prefix + r

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = (offs_m < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_rows = (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows + offs_d[None, :] * stride_qd,
                mask=row_mask, other=0.0)  # q: [BLOCK_M, BLOCK_D]
    q_pos = prefix + offs_m  # [BLOCK_M]

    table_row = table_ptr + seq.to(tl.int64) * stride_tb
    head_off = (head // GROUP) * stride_ch
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # tiles past this sequence's queries (the grid is sized for the longest chunk) do nothing
    in_range = m_block * BLOCK_M < q_len
    # keys up to the tile's first query position are visible to every row of the tile
    full_end = tl.where(in_range, (prefix + m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N, 0)
    # the causal limit: one past the tile's last query position
    causal_end = tl.where(in_range, tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M), 0)

    for start in range(0, full_end, BLOCK_N):
        k, v, valid = load_kv_tile(k_ptr, v_ptr, table_row, start + offs_n, seq_len, head_off,
                                   offs_d, stride_cb, stride_cs, stride_cd, HEAD_DIM, BLOCK_SIZE)
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, valid[None, :], scale_log2,
                                            DOT_PRECISION)
    # the diagonal tiles; if full_end is 0 the first of them holds key 0, visible to every row
    for start in range(full_end, causal_end, BLOCK_N):
        pos = start + offs_n
        k, v, valid = load_kv_tile(k_ptr, v_ptr, table_row, pos, seq_len, head_off, offs_d,
                                   stride_cb, stride_cs, stride_cd, HEAD_DIM, BLOCK_SIZE)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, visible, scale_log2,
                                            DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_rows = (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
    tl.store(out_ptr + out_rows + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_mask)


def prefill_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, *, tiles: PrefillTiles | None = None,
) -> torch.Tensor:
    """Same contract as `gpu.attention.prefill_attention_torch`; never synchronises (the grid is
    sized from the host-side query lengths).

    q: [num_prefill_tokens, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (strided
    arena views) -> [num_prefill_tokens, Hq, D].
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride(), "K and V views of one arena share a layout"
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    out = torch.empty_like(q)
    max_query_len = max(meta.query_lens_host[:meta.num_prefills], default=0)
    if num_tokens == 0 or max_query_len == 0:
        return out
    tiles = tiles or prefill_tiles(head_dim, q.dtype)
    grid = (triton.cdiv(max_query_len, tiles.block_m), num_q_heads, meta.num_prefills)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        scale * LOG2E,
        *q.stride(), *out.stride(), *k_cache.stride(), meta.block_tables.stride(0),
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out
