"""Random paged batches for checking attention against a reference: the tests and
bench/kernels_gpu.py build their inputs here.

A batch is laid out like the engine's: one arena [num_blocks, num_layers, 2, block_size, Hkv, D]
whose per-layer K and V views are strided (stride(0) spans every layer of a block), sequences on
shuffled arena-global block ids, and every slot a sequence does not own poisoned with NaN so that
any read past a sequence's length shows in the output.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from gpu.attention import write_kv
from gpu.metadata import AttentionMetadata


@attrs.frozen(kw_only=True)
class PagedBatch:
    """One step's attention inputs, and the dense K/V each sequence was built from."""

    q: torch.Tensor
    """[T, Hq, D]: prefill tokens first, then one token per decode."""
    k_cache: torch.Tensor
    """[num_blocks, block_size, Hkv, D], a strided view into `arena`."""
    v_cache: torch.Tensor
    arena: torch.Tensor
    """[num_blocks, num_layers, 2, block_size, Hkv, D]."""
    meta: AttentionMetadata
    keys: list[torch.Tensor]
    """Per sequence, [seq_len, Hkv, D]: its whole context in order."""
    values: list[torch.Tensor]


def make_paged_batch(
    *,
    prefills: Sequence[tuple[int, int]] = (),
    decode_lens: Sequence[int] = (),
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    num_layers: int = 2,
    layer: int = 1,
    arena_blocks: int | None = None,
    pad_block_id: int = 2**30,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """prefills: (query_len, seq_len) per prefill chunk, seq_len - query_len tokens already
    cached; decode_lens: seq_len per decoding sequence. `pad_block_id` fills block table entries
    past a sequence's blocks: the default lies outside any arena, so reading one faults."""
    # block ids come from a CPU generator, values from one on the device (big batches for the
    # bench are generated where they are used)
    gen_ids = torch.Generator(device="cpu").manual_seed(seed)
    gen_values = torch.Generator(device=device).manual_seed(seed)
    query_lens = [ql for ql, _ in prefills] + [1] * len(decode_lens)
    seq_lens = [sl for _, sl in prefills] + list(decode_lens)
    assert all(0 < ql <= sl for ql, sl in zip(query_lens, seq_lens)), (query_lens, seq_lens)
    blocks_per_seq = [-(-sl // block_size) for sl in seq_lens]
    needed = sum(blocks_per_seq)
    arena_blocks = arena_blocks or 2 * needed + 3
    assert arena_blocks >= needed, (arena_blocks, needed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen_values, device=device).to(dtype)

    arena = randn(arena_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    arena[:, layer] = float("nan")
    k_cache, v_cache = arena[:, layer, 0], arena[:, layer, 1]
    ids = torch.randperm(arena_blocks, generator=gen_ids)[:needed].tolist()
    table = torch.full((len(seq_lens), max(blocks_per_seq, default=1) + 1), pad_block_id,
                       dtype=torch.int32)
    keys, values, slots = [], [], []
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        table[i, :blocks_per_seq[i]] = torch.tensor(ids[:blocks_per_seq[i]])
        ids = ids[blocks_per_seq[i]:]
        keys.append(randn(sl, num_kv_heads, head_dim))
        values.append(randn(sl, num_kv_heads, head_dim))
        pos = torch.arange(sl)
        seq_slots = table[i, pos // block_size].long() * block_size + pos % block_size  # [sl]
        # the cached prefix was written by earlier steps; this step's tokens go through write_kv
        prefix = sl - ql
        blocks, offsets = seq_slots[:prefix] // block_size, seq_slots[:prefix] % block_size
        k_cache[blocks.to(device), offsets.to(device)] = keys[-1][:prefix]
        v_cache[blocks.to(device), offsets.to(device)] = values[-1][:prefix]
        slots.append(seq_slots[prefix:])
    slot_mapping = torch.cat(slots).to(device) if slots else torch.zeros(0, dtype=torch.long)
    new_k = torch.cat([k[sl - ql:] for k, ql, sl in zip(keys, query_lens, seq_lens)])
    new_v = torch.cat([v[sl - ql:] for v, ql, sl in zip(values, query_lens, seq_lens)])
    write_kv(k_cache, v_cache, new_k, new_v, slot_mapping)

    query_start = [0]
    for ql in query_lens:
        query_start.append(query_start[-1] + ql)
    meta = AttentionMetadata(
        num_prefills=len(prefills),
        num_prefill_tokens=sum(ql for ql, _ in prefills),
        num_decodes=len(decode_lens),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        slot_mapping=slot_mapping,
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return PagedBatch(q=randn(query_start[-1], num_q_heads, head_dim), k_cache=k_cache,
                      v_cache=v_cache, arena=arena, meta=meta, keys=keys, values=values)
