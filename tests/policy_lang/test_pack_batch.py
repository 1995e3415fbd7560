"""Packing keeps the batch's shape as five summed integers (policy_lang/pack_batch.py) instead
of building a BatchShape per candidate: the predictions must be exactly those of the shape
built from the chunks, through adds and removals, or packing would decide differently."""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cost_model import LLAMA3_8B_A100, BatchShape, CopyCost
from policy_lang.pack_batch import plus

COST = attrs.evolve(LLAMA3_8B_A100, copy=CopyCost(bandwidth_gb_per_s=25.0, dispatch_us=5.0),
                    block_bytes=1 << 17)  # the copy term too
chunk = st.tuples(st.integers(0, 4096), st.sampled_from([1, 1, 1, 2, 17, 512]))


@settings(max_examples=100, deadline=None)
@given(chunks=st.lists(chunk, max_size=40), drops=st.lists(st.integers(0, 39), max_size=5),
       copies=st.integers(0, 64))
def test_summed_shape_predicts_exactly_as_the_built_one(chunks, drops, copies):
    shape, held = [0, 0, 0, 0, 0], []
    for c in chunks:
        shape = plus(shape, c, 1)
        held.append(c)
    for d in drops:
        if held:
            shape = plus(shape, held.pop(d % len(held)), -1)
    built = BatchShape.of(held)
    assert shape == [built.prefill_tokens, built.prefill_sq, built.prefill_prefix,
                     built.decode_seqs, built.decode_context]
    assert COST.iteration_of(*shape, copies) == COST.predict_iteration_ms(built, copies)
    assert COST.iteration_of(*shape) == COST.predict_ms(built)
