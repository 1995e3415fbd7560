"""Attention over a paged KV cache: the torch path (CPU, and the reference every kernel is checked
against) and the dispatch to the Triton kernels on CUDA.

A step's tokens are flattened: the prefill chunks come first (one sequence after another), then
one token per decoding sequence. Every sequence attends to its own KV, which this step has already
written into the cache, through its block table.

Cache views are per layer: `k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim],
strided views into the arena (not contiguous: a block holds every layer, see gpu/arena.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from gpu.metadata import AttentionMetadata

AttentionBackend = Literal["torch", "triton"]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """Store this step's keys and values. k, v: [T, Hkv, D]; slot_mapping: [T]."""
    block_size = k_cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens: [length, Hkv, D]. A negative table entry
    `-b - 1` is block b filled right to left (BROS §5.1)."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    entries = block_table[:num_blocks].long()
    pos = torch.arange(length, device=cache.device)
    blocks, offsets = _physical(entries[pos // block_size], pos % block_size, block_size)
    return cache[blocks, offsets]


def _physical(entries, offsets, block_size: int):
    """(block, slot offset) of logical `offsets` in the blocks `entries` name (torch or numpy,
    elementwise); a negative entry is a block filled right to left."""
    reverse = entries < 0
    blocks = reverse * (-entries - 1) + ~reverse * entries
    return blocks, reverse * (block_size - 1 - offsets) + ~reverse * offsets


def prefill_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each prefill chunk over its cached prefix and itself.

    q: [num_prefill_tokens, Hq, D] -> [num_prefill_tokens, Hq, D]. With this step's keys and
    values (`k_new`, `v_new`: [num_prefill_tokens, Hkv, D]), a chunk with no cached prefix
    attends to them directly, causal, without reading the cache back.
    """
    out = torch.empty_like(q)
    start = 0
    for i in range(meta.num_prefills):
        qlen, kvlen = meta.query_lens_host[i], meta.seq_lens_host[i]
        prefix = kvlen - qlen
        qi = q[start:start + qlen].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
        if prefix == 0 and k_new is not None and v_new is not None:
            k, v = k_new[start:start + qlen], v_new[start:start + qlen]
            mask, causal = None, True
        else:
            k = _gather_kv(k_cache, meta.block_tables[i], kvlen)  # [S, Hkv, D]
            v = _gather_kv(v_cache, meta.block_tables[i], kvlen)
            # query j sits at position prefix + j and sees keys 0 ..= prefix + j
            rows = torch.arange(qlen, device=q.device).unsqueeze(1) + prefix
            mask = torch.arange(kvlen, device=q.device).unsqueeze(0) <= rows  # [L, S]
            causal = False
        o = F.scaled_dot_product_attention(
            qi, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
        )
        out[start:start + qlen] = o[0].transpose(0, 1)
        start += qlen
    return out


DECODE_BUCKET = 16
"""The torch decode path pads each group of this many sequences (sorted by length) to the
group's longest, not the whole batch to the batch's longest."""


@attrs.frozen
class DecodeGroup:
    """Sequences of similar length that the torch decode path attends for together."""

    rows: torch.Tensor
    """int64 [b]: the group's sequences, as rows of the decode batch."""
    blocks: torch.Tensor
    """int64 [b * n]: the n blocks each sequence reads, whole (n: the group's most blocks)."""
    valid: torch.Tensor
    """bool [b, 1, 1, n * block_size]: the slots, in block and slot order, that hold one of the
    sequence's tokens (a reversed block's tokens sit at its end)."""
    stale: torch.Tensor
    """int64 [m]: the other slots, as rows of the gathered [b * n * block_size] slots."""


@attrs.frozen
class DecodePlan:
    """Which cache blocks each decoding sequence reads, worked out once per step for every layer
    (the torch path). Whole blocks are gathered: `index_select` of whole blocks is 5-10x faster
    on CPU than gathering slot by slot, and attention does not care about the order of its keys.
    A block's slots outside the sequence (its unwritten tail, a bidirectional block's other
    owner) are masked, and zeroed in the gathered copy first: they may hold anything a previous
    owner left, and 0 x NaN would still be NaN. The sequence's own slots are left as they are,
    so a bad value there still shows. Table entries past a sequence's blocks are never read:
    they name its first block again, all of it masked."""

    groups: tuple[DecodeGroup, ...]


def plan_decode(block_tables: torch.Tensor, seq_lens_host: Sequence[int], block_size: int,
                bucket: int = DECODE_BUCKET) -> DecodePlan:
    """block_tables: [B, max_blocks] (entries past a sequence's blocks are ignored);
    seq_lens_host: B lengths, each at least 1."""
    device = block_tables.device
    tables = block_tables.cpu().numpy()
    lens = np.asarray(seq_lens_host, dtype=np.int64)
    order = np.argsort(lens, kind="stable")
    slot = np.arange(block_size)
    groups = []
    for first in range(0, len(order), bucket):
        rows = order[first:first + bucket]
        n = -(-int(lens[rows].max()) // block_size)
        owned = np.arange(n)[None, :] < -(-lens[rows, None] // block_size)  # [b, n]
        entries = np.where(owned, tables[rows, :n].astype(np.int64), tables[rows, :1])
        # the mapping of a token offset to its slot is its own inverse, so the same call gives
        # the token offset each physical slot holds (reversed blocks: bs - 1 - o)
        blocks, offset = _physical(entries[:, :, None], slot, block_size)  # [b, n, 1], [b, n, bs]
        position = np.arange(n)[None, :, None] * block_size + offset
        valid = owned[:, :, None] & (position < lens[rows, None, None])
        groups.append(DecodeGroup(
            rows=torch.from_numpy(rows.astype(np.int64)).to(device),
            blocks=torch.from_numpy(blocks.reshape(-1)).to(device),
            valid=torch.from_numpy(valid).to(device).view(len(rows), 1, 1, n * block_size),
            stale=torch.from_numpy(np.flatnonzero(~valid)).to(device)))
    return DecodePlan(groups=tuple(groups))


def decode_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
    seq_lens_host: Sequence[int] | None = None, plan: DecodePlan | None = None,
) -> torch.Tensor:
    """One query per sequence over its whole cached context.

    q: [B, Hq, D]; block_tables: [B, max_blocks]; seq_lens: [B] -> [B, Hq, D]. Sequences of
    similar length are batched together (`plan_decode`), so a few long contexts do not make
    every short one read as many slots. A step's layers share one `plan`. `max_seq_len` is
    not needed here; the argument list is the Triton kernel's, so tests call both alike.
    """
    if plan is None:
        lens = seq_lens_host if seq_lens_host is not None else seq_lens.tolist()
        plan = plan_decode(block_tables, lens, k_cache.shape[1])
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    num_kv_heads = k_cache.shape[2]
    for g in plan.groups:
        b, span = g.rows.shape[0], g.valid.shape[-1]
        # whole blocks, the slots outside each sequence zeroed (see DecodePlan): [b, S, Hkv, D]
        k = k_cache.index_select(0, g.blocks).view(b, span, num_kv_heads, head_dim)
        v = v_cache.index_select(0, g.blocks).view(b, span, num_kv_heads, head_dim)
        k.view(b * span, -1).index_fill_(0, g.stale, 0.0)
        v.view(b * span, -1).index_fill_(0, g.stale, 0.0)
        o = F.scaled_dot_product_attention(
            q[g.rows].view(b, num_heads, 1, head_dim), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=g.valid, scale=scale, enable_gqa=True)  # [b, Hq, 1, D]
        out[g.rows] = o.view(b, num_heads, head_dim)
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, backend: AttentionBackend = "torch",
    decode_plan: DecodePlan | None = None,
    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for a whole step. q: [T, Hq, D] -> [T, Hq, D]. The torch path takes the
    step's `decode_plan` (built once for all layers) or builds one, and the step's own keys
    and values (`k_new`, `v_new`: [T, Hkv, D], already in the cache) for fresh prompts."""
    out = torch.empty_like(q)
    npt, s = meta.num_prefill_tokens, meta.num_prefills
    decode_args = (q[npt:], k_cache, v_cache, meta.block_tables[s:], meta.seq_lens[s:],
                   max(meta.seq_lens_host[s:], default=0), scale)
    if backend == "triton":
        # imported here, not at the top: triton is a Linux-only dependency the torch path never
        # needs, and it decides between compiling and interpreting (TRITON_INTERPRET) on import
        from gpu.kernels import decode_attention_triton, prefill_attention_triton

        if s:
            out[:npt] = prefill_attention_triton(q[:npt], k_cache, v_cache, meta, scale)
        if meta.num_decodes:
            out[npt:] = decode_attention_triton(*decode_args)
        return out
    if s:
        fresh = (None, None) if k_new is None or v_new is None else (k_new[:npt], v_new[:npt])
        out[:npt] = prefill_attention_torch(q[:npt], k_cache, v_cache, meta, scale, *fresh)
    if meta.num_decodes:
        out[npt:] = decode_attention_torch(*decode_args, seq_lens_host=meta.seq_lens_host[s:],
                                           plan=decode_plan)
    return out
