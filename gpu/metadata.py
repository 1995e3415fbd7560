"""Building one step's flattened inputs and `AttentionMetadata` from per-sequence chunks.

A chunk is (token_ids, start_pos, block_table): the new tokens of one sequence, the position of
the first of them (= tokens already cached), and the sequence's block ids covering
start_pos + len(token_ids) tokens. The caller orders chunks prefills first, then decodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

SeqChunk = tuple[Sequence[int], int, Sequence[int]]


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
    """int32 [S, max_blocks]: arena block ids, `-b - 1` for block b filled right to left (BROS
    §5.1); entries past a sequence's length are padding."""
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


@attrs.frozen(kw_only=True)
class StepInputs:
    """Everything `CausalLM.forward` takes for one step."""

    input_ids: torch.Tensor
    """int64 [T]: every chunk's tokens, in chunk order."""
    positions: torch.Tensor
    """int64 [T]: each token's position in its sequence."""
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    """int64 [S]: the last token of each chunk (where the next token is predicted)."""


def _count_prefills(query_lens: list[int]) -> int:
    """Sequences up to the last multi-token chunk are prefills; a one-token chunk after it is a
    decode (its attention is the same either way)."""
    return max((i + 1 for i, n in enumerate(query_lens) if n != 1), default=0)


def physical_slots(positions: np.ndarray, table: np.ndarray, block_size: int) -> np.ndarray:
    """Flat cache slots of `positions` through a block table whose entries carry a direction
    (BROS §5.1, engine/memory/bidirectional.py): `b` fills block b left to right, `-b - 1` right
    to left, so logical offset i of a reversed entry is slot `block_size - 1 - i`."""
    entries = table[positions // block_size]
    offsets = positions % block_size
    reverse = entries < 0
    blocks = np.where(reverse, -entries - 1, entries)
    return blocks * block_size + np.where(reverse, block_size - 1 - offsets, offsets)


def _slots(start: int, count: int, table: np.ndarray, block_size: int) -> np.ndarray:
    return physical_slots(np.arange(start, start + count), table, block_size)


def _check_chunk(i: int, count: int, end: int, num_blocks: int, block_size: int,
                 decode: bool) -> None:
    if count == 0:
        raise ValueError(f"sequence {i} has no new tokens")
    if decode and count != 1:
        raise ValueError(f"sequence {i} is a decode (it follows the prefills) but has "
                         f"{count} tokens")
    if num_blocks * block_size < end:
        raise ValueError(f"sequence {i}: block table of {num_blocks} blocks holds "
                         f"{num_blocks * block_size} tokens, needs {end}")


def build_metadata(seqs: Sequence[SeqChunk], block_size: int, device: str | torch.device,
                   *, num_prefills: int | None = None) -> AttentionMetadata:
    """AttentionMetadata for chunks ordered prefills first, then one-token decodes (the caller
    sorts them). num_prefills None: everything up to the last multi-token chunk."""
    query_lens = [len(tokens) for tokens, _, _ in seqs]
    if num_prefills is None:
        num_prefills = _count_prefills(query_lens)
    seq_lens, slots, tables = [], [], []
    for i, (tokens, start, table) in enumerate(seqs):
        _check_chunk(i, len(tokens), start + len(tokens), len(table), block_size,
                     decode=i >= num_prefills)
        seq_lens.append(start + len(tokens))
        tables.append(np.asarray(table, dtype=np.int64))
        slots.append(_slots(start, len(tokens), tables[-1], block_size))
    width = max((len(t) for t in tables), default=0)
    padded = np.zeros((len(seqs), width), dtype=np.int32)  # [S, max_blocks]
    for i, table in enumerate(tables):
        padded[i, :len(table)] = table
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return AttentionMetadata(
        num_prefills=num_prefills,
        num_prefill_tokens=int(qsl[num_prefills]),
        num_decodes=len(seqs) - num_prefills,
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(padded).to(device),
        slot_mapping=torch.from_numpy(np.concatenate(slots or [np.zeros(0, np.int64)])).to(device),
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )


def build_step_inputs(seqs: Sequence[SeqChunk], block_size: int, device: str | torch.device,
                      sample: Sequence[bool] | None = None) -> StepInputs:
    """Flattened tokens and positions, the metadata, and logits at the last token of each chunk
    (of each chunk whose `sample` flag is set, when flags are given)."""
    meta = build_metadata(seqs, block_size, device)
    ids = [t for tokens, _, _ in seqs for t in tokens]
    positions = np.concatenate(
        [np.arange(start, start + len(tokens)) for tokens, start, _ in seqs] or [np.zeros(0)])
    last = np.cumsum([len(tokens) for tokens, _, _ in seqs], dtype=np.int64) - 1
    if sample is not None:
        last = last[np.asarray(sample, dtype=bool)]
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.from_numpy(positions.astype(np.int64)).to(device),
        meta=meta,
        logits_indices=torch.from_numpy(last.astype(np.int64)).to(device),
    )
