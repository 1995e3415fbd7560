"""Attention over a paged KV cache: the torch path (CPU, and the reference every kernel is checked
against) and the dispatch to the Triton kernels on CUDA.

A step's tokens are flattened: the prefill chunks come first (one sequence after another), then
one token per decoding sequence. Every sequence attends to its own KV, which this step has already
written into the cache, through its block table.

Cache views are per layer: `k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim],
strided views into the arena (not contiguous: a block holds every layer, see gpu/arena.py).
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
import torch.nn.functional as F

AttentionBackend = Literal["torch", "triton"]


@attrs.frozen(kw_only=True)
class AttentionMetadata:
    """Where each sequence's queries are and which KV blocks it reads, for one step."""

    num_prefills: int
    """Sequences [0, num_prefills) are prefill chunks (any number of new tokens, maybe a cached
    prefix before them)."""
    num_prefill_tokens: int
    """Their tokens come first in the flattened batch."""
    num_decodes: int
    """Sequences after the prefills, one new token each."""
    query_start_loc: torch.Tensor
    """int32 [S+1]: cumulative query lengths; sequence i owns tokens [qsl[i], qsl[i+1])."""
    seq_lens: torch.Tensor
    """int32 [S]: KV length of each sequence after this step's tokens are written."""
    block_tables: torch.Tensor
    """int32 [S, max_blocks]: arena block ids; entries past a sequence's length are padding."""
    slot_mapping: torch.Tensor
    """int64 [T]: block_id * block_size + offset, where each new token's K/V is written."""
    query_lens_host: tuple[int, ...]
    """The same query lengths as host ints, so the torch path never synchronises."""
    seq_lens_host: tuple[int, ...]
    """The same KV lengths as host ints."""

    @property
    def num_seqs(self) -> int:
        return self.num_prefills + self.num_decodes

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)


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
    """One sequence's first `length` cached tokens: [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache[block_table[:num_blocks].long()]  # [nb, bs, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def prefill_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Causal attention of each prefill chunk over its cached prefix and itself.

    q: [num_prefill_tokens, Hq, D] -> [num_prefill_tokens, Hq, D].
    """
    out = torch.empty_like(q)
    start = 0
    for i in range(meta.num_prefills):
        qlen, kvlen = meta.query_lens_host[i], meta.seq_lens_host[i]
        prefix = kvlen - qlen
        k = _gather_kv(k_cache, meta.block_tables[i], kvlen)  # [S, Hkv, D]
        v = _gather_kv(v_cache, meta.block_tables[i], kvlen)
        # query j sits at position prefix + j and sees keys 0 ..= prefix + j
        rows = torch.arange(qlen, device=q.device).unsqueeze(1) + prefix
        mask = torch.arange(kvlen, device=q.device).unsqueeze(0) <= rows  # [L, S]
        qi = q[start:start + qlen].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
        o = F.scaled_dot_product_attention(
            qi, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        out[start:start + qlen] = o[0].transpose(0, 1)
        start += qlen
    return out


DECODE_BUCKET = 16
"""The torch decode path pads each group of this many sequences (sorted by length) to the
group's longest, not the whole batch to the batch's longest."""


def decode_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
    seq_lens_host: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """One query per sequence over its whole cached context, batched with a length mask.

    q: [B, Hq, D]; block_tables: [B, max_blocks]; seq_lens: [B] -> [B, Hq, D]. With
    `seq_lens_host`, sequences of similar length are batched together, so a few long contexts
    do not make every short one read (and mask) as many slots.
    """
    batch = q.shape[0]
    if seq_lens_host is None or batch <= DECODE_BUCKET:
        return _decode_group(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale)
    out = torch.empty_like(q)
    order = sorted(range(batch), key=seq_lens_host.__getitem__)
    for i in range(0, batch, DECODE_BUCKET):
        rows = order[i:i + DECODE_BUCKET]
        idx = torch.tensor(rows, device=q.device)
        out[idx] = _decode_group(q[idx], k_cache, v_cache, block_tables[idx], seq_lens[idx],
                                 seq_lens_host[rows[-1]], scale)
    return out


def _decode_group(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, scale: float,
) -> torch.Tensor:
    batch, block_size = q.shape[0], k_cache.shape[1]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_blocks = -(-max_seq_len // block_size)
    slots = num_blocks * block_size
    # table entries past a sequence's blocks are padding of any value: read block 0 instead
    starts = torch.arange(num_blocks, device=q.device) * block_size  # [nb]
    table = block_tables[:, :num_blocks].long()
    table = torch.where(starts.unsqueeze(0) < seq_lens.unsqueeze(1), table, 0)  # [B, nb]
    k = k_cache[table].view(batch, slots, num_kv_heads, head_dim)  # [B, S, Hkv, D]
    v = v_cache[table].view(batch, slots, num_kv_heads, head_dim)
    valid = torch.arange(slots, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, S]
    # grouped-query attention: the query heads of one KV head side by side
    qg = q.view(batch, num_kv_heads, -1, head_dim)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bshd->bhgs", qg.float(), k.float()) * scale
    # slots past a sequence's length hold stale data, maybe NaN/inf (an empty arena): the fill
    # replaces their scores whatever they were, and V is zeroed there, since 0 * NaN is NaN
    scores.masked_fill_(~valid.view(batch, 1, 1, slots), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    v = v.float().masked_fill(~valid.view(batch, slots, 1, 1), 0.0)
    out = torch.einsum("bhgs,bshd->bhgd", probs, v)  # [B, Hkv, G, D]
    return out.reshape(batch, -1, head_dim).to(q.dtype)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, backend: AttentionBackend = "torch",
) -> torch.Tensor:
    """Attention for a whole step. q: [T, Hq, D] -> [T, Hq, D]."""
    out = torch.empty_like(q)
    npt, nd = meta.num_prefill_tokens, meta.num_decodes
    if backend == "triton":
        from gpu.kernels import decode_attention_triton, prefill_attention_triton

        prefill, decode = prefill_attention_triton, decode_attention_triton
    else:
        prefill, decode = prefill_attention_torch, decode_attention_torch
    if meta.num_prefills:
        out[:npt] = prefill(q[:npt], k_cache, v_cache, meta, scale)
    if nd:
        s = meta.num_prefills
        args = (q[npt:], k_cache, v_cache, meta.block_tables[s:], meta.seq_lens[s:],
                max(meta.seq_lens_host[s:]), scale)
        if backend == "triton":
            out[npt:] = decode(*args)
        else:
            out[npt:] = decode(*args, seq_lens_host=meta.seq_lens_host[s:])
    return out
