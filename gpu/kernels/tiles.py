"""Device helpers shared by the paged attention kernels: finding a tile of keys through a block
table, and one step of the online softmax.

Both are `@triton.jit` functions, inlined into the kernels that call them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
"""exp(x) == exp2(x * LOG2E): the kernels fold LOG2E into the softmax scale and use exp2, which
maps to one hardware instruction (as FlashAttention-2's Triton kernels do)."""


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get true fp32 products; tf32 (the GPU default) would break fp32 tolerances.

    16-bit inputs ignore the option, so they get the default.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def load_kv_tile(k_ptr, v_ptr, table_row_ptr, pos, seq_len, head_off, offs_d,
                 stride_block, stride_slot, stride_dim,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """K and V [BLOCK_N, BLOCK_D] of cache positions `pos` [BLOCK_N] of one sequence and KV
    head, zero where a position lies past `seq_len`, and which positions are valid.

    Each position looks its block up on its own (and its direction, from the entry's sign), so a tile may span several cache blocks or part
    of one (as vLLM's Triton unified attention does); table entries past `seq_len` are never read,
    so their padding value does not matter.
    """
    valid = pos < seq_len
    entries = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
    # an entry -b - 1 is block b filled right to left (BROS §5.1): offset i is slot bs - 1 - i
    reverse = entries < 0
    block_ids = tl.where(reverse, -entries - 1, entries)
    offsets = pos % BLOCK_SIZE
    slots = tl.where(reverse, BLOCK_SIZE - 1 - offsets, offsets)
    # arena-global block ids times a whole-block stride overflow int32 on big arenas
    rows = block_ids.to(tl.int64) * stride_block + slots * stride_slot + head_off
    ptrs = rows[:, None] + offs_d[None, :] * stride_dim
    mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + ptrs, mask=mask, other=0.0)
    v = tl.load(v_ptr + ptrs, mask=mask, other=0.0)
    return k, v, valid


@triton.jit
def online_softmax_step(acc, m_i, l_i, q, k, v, score_mask, scale_log2,
                        DOT_PRECISION: tl.constexpr):
    """Fold one tile of keys into the running (acc, max, sum): online softmax as in
    FlashAttention (Dao et al. 2022, Alg. 1), in base 2.

    q: [M, D]; k, v: [N, D]; score_mask: broadcastable to [M, N], True where a query may see a key.
    The caller guarantees every row has seen an unmasked key by its first tile, so m_new is finite.
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, N] fp32
    s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # p in v's dtype so 16-bit inputs use the tensor cores; the product accumulates in fp32
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
