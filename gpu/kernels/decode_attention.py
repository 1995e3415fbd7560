"""Decode attention over a paged KV cache: one new query token per sequence.

One program per (sequence, KV head, split) reads that head's keys and values once for all G query
heads of its group (grouped-query attention): decode is memory-bound, so K/V traffic, not FLOPs,
is the cost (vLLM's paged attention kernel, with the GQA packing of its Triton unified attention).
When sequences x KV heads are too few to fill the GPU, each sequence's context is cut into splits
whose partial softmax states a second kernel merges (flash-decoding, Dao et al. 2023).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from gpu.kernels.tiles import LOG2E, dot_precision, load_kv_tile, online_softmax_step

_MIN_SPLIT_KEYS = 256
"""A split reads at least this many keys: below it, merging costs more than the split saves."""
_MAX_SPLITS = 32


@attrs.frozen(kw_only=True)
class DecodeTiles:
    """Launch shape of the decode kernel."""

    block_n: int = 64
    """Keys per loop iteration; a power of two >= 16, independent of the cache block size."""
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int | None = None
    """Programs per (sequence, KV head); None picks from the batch shape (`decode_splits`)."""


def decode_tiles(head_dim: int, dtype: torch.dtype) -> DecodeTiles:
    """A fixed heuristic (autotuning would synchronise and re-run on every new shape): the
    largest tile that ptxas fits in registers without spilling for sm_90, checked with triton
    3.9; bench/kernels_gpu.py times the alternatives on a real GPU."""
    if head_dim <= 64:
        return DecodeTiles(block_n=64, num_warps=4)
    if dtype == torch.float32:
        return DecodeTiles(block_n=32, num_warps=4)
    return DecodeTiles(block_n=64, num_warps=8)


def decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough programs for two per SM, but no split shorter than _MIN_SPLIT_KEYS keys.

    Only host values: the device properties are cached by torch, nothing synchronises.
    """
    if device.type != "cuda":
        return 1
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(programs, batch * num_kv_heads)
    return max(1, min(wanted, max_seq_len // _MIN_SPLIT_KEYS, _MAX_SPLITS))


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, seq_lens_ptr, scale_log2,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_ob, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_tb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    # the G query heads of this KV head, padded to GROUP_PAD >= 16 rows so tl.dot compiles
    heads = kv_head * GROUP + offs_g
    q_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)  # q: [GROUP_PAD, BLOCK_D]

    # each sequence cuts its own length, read on the device, into num_splits runs of whole tiles,
    # so the result never depends on the host's max_seq_len (a replayed CUDA graph stays right)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = (seq_len + num_splits * BLOCK_N - 1) // (num_splits * BLOCK_N) * BLOCK_N
    kv_start = split * split_len
    kv_end = tl.minimum(seq_len, kv_start + split_len)
    table_row = table_ptr + seq.to(tl.int64) * stride_tb
    head_off = kv_head * stride_ch
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    # every tile starts below seq_len, so each one holds a visible key: m_i is finite after it
    for start in range(kv_start, kv_end, BLOCK_N):
        k, v, valid = load_kv_tile(k_ptr, v_ptr, table_row, start + offs_n, seq_len, head_off,
                                   offs_d, stride_cb, stride_cs, stride_cd, HEAD_DIM, BLOCK_SIZE)
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, valid[None, :], scale_log2,
                                            DOT_PRECISION)

    if SPLIT:
        # unnormalised state; a split past the sequence's end leaves (0, -inf, 0), weight 0
        row = (seq * GROUP * tl.num_programs(1) + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        tl.store(part_max_ptr + row, m_i, mask=offs_g < GROUP)
        tl.store(part_sum_ptr + row, l_i, mask=offs_g < GROUP)
    else:
        # a sequence of length 0 attends to nothing: write zeros rather than 0/0
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh
        tl.store(out_ptrs + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
                 mask=q_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_splits,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Softmax states of one (sequence, query head)'s splits -> its output, rescaled to a common
    max as in the online softmax."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    rows = (seq * tl.num_programs(1) + head) * num_splits + offs_s  # [SPLITS_PAD]
    m = tl.load(part_max_ptr + rows, mask=s_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + rows, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: length 0
    weight = tl.exp2(m - m_max)  # [SPLITS_PAD], 0 for empty splits
    total = tl.sum(weight * l, 0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
    *, tiles: DecodeTiles | None = None,
) -> torch.Tensor:
    """Same contract as `gpu.attention.decode_attention_torch`; never synchronises
    (`max_seq_len` only sizes the grid).

    q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (strided arena views);
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 -> [B, Hq, D].
    """
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride(), "K and V views of one arena share a layout"
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    tiles = tiles or decode_tiles(head_dim, q.dtype)
    splits = tiles.num_splits or decode_splits(batch, num_kv_heads, max_seq_len, q.device)
    group = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    # partial states per (sequence, query head, split); only touched when splitting
    part_acc = torch.empty((batch, num_q_heads, splits, head_dim) if splits > 1 else (1,),
                           dtype=torch.float32, device=q.device)
    part_max = torch.empty((batch, num_q_heads, splits) if splits > 1 else (1,),
                           dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, out, block_tables, seq_lens, scale * LOG2E,
        part_acc, part_max, part_sum,
        *q.stride(), *out.stride(), *k_cache.stride(), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=tiles.block_n,
        DOT_PRECISION=dot_precision(q.dtype), SPLIT=splits > 1,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if splits > 1:
        _merge_splits_kernel[(batch, num_q_heads)](
            out, part_acc, part_max, part_sum, splits, *out.stride(),
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS_PAD=triton.next_power_of_2(splits),
        )
    return out
