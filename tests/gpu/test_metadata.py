"""build_metadata / build_step_inputs: flattened layout, slots through block tables, prefills
counted from the chunk lengths, and the errors."""

from __future__ import annotations

import pytest
import torch

from gpu.metadata import build_metadata, build_step_inputs


def test_layout_of_a_mixed_step() -> None:
    # a prefill with 5 cached tokens, a fresh prefill, then two decodes; block_size 4
    seqs = [([10, 11, 12], 5, [7, 3]), ([20, 21], 0, [9]), ([30], 6, [2, 8]), ([40], 0, [5])]
    inputs = build_step_inputs(seqs, 4, "cpu")
    meta = inputs.meta
    assert (meta.num_prefills, meta.num_prefill_tokens, meta.num_decodes) == (2, 5, 2)
    assert inputs.input_ids.tolist() == [10, 11, 12, 20, 21, 30, 40]
    assert inputs.positions.tolist() == [5, 6, 7, 0, 1, 6, 0]
    assert inputs.logits_indices.tolist() == [2, 4, 5, 6]
    assert meta.query_start_loc.tolist() == [0, 3, 5, 6, 7]
    assert meta.seq_lens.tolist() == [8, 2, 7, 1]
    assert (meta.query_lens_host, meta.seq_lens_host) == ((3, 2, 1, 1), (8, 2, 7, 1))
    # position p of a sequence lands in slot table[p // 4] * 4 + p % 4
    assert meta.slot_mapping.tolist() == [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 36, 37, 34, 20]
    assert meta.block_tables.tolist() == [[7, 3], [9, 0], [2, 8], [5, 0]]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.slot_mapping.dtype == inputs.positions.dtype == torch.int64


def test_one_token_chunks_before_the_last_long_one_are_prefills() -> None:
    seqs = [([1], 4, [0, 1]), ([2, 3], 0, [2]), ([4], 3, [3])]
    assert build_metadata(seqs, 4, "cpu").num_prefills == 2
    assert build_metadata(seqs[2:], 4, "cpu").num_prefills == 0
    assert build_metadata(seqs[2:], 4, "cpu", num_prefills=1).num_prefill_tokens == 1


@pytest.mark.parametrize(("seqs", "message"), [
    ([([1, 2, 3], 3, [0])], "sequence 0: block table of 1 blocks holds 4 tokens, needs 6"),
    ([([1], 0, [0]), ([], 0, [1])], "sequence 1 has no new tokens"),
])
def test_errors(seqs: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_metadata(seqs, 4, "cpu")


def test_decode_with_many_tokens_is_an_error() -> None:
    with pytest.raises(ValueError, match="sequence 1 is a decode \\(it follows the prefills\\) "
                                         "but has 2 tokens"):
        build_metadata([([1, 2], 0, [0]), ([3, 4], 0, [1])], 4, "cpu", num_prefills=1)
