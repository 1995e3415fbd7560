"""Pipeline plans: layer ranges, microbatch cuts, and the stage-by-stage timing (bubbles)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.cluster.plan import pipeline_timing, split_microbatches, stage_layers


@pytest.mark.parametrize("layers,stages,want", [
    (4, 2, [range(0, 2), range(2, 4)]),
    (5, 2, [range(0, 3), range(3, 5)]),
    (32, 3, [range(0, 11), range(11, 22), range(22, 32)]),
    (2, 2, [range(0, 1), range(1, 2)]),
    (3, 1, [range(0, 3)]),
])
def test_stage_layers_are_contiguous_and_balanced(layers, stages, want):
    assert list(stage_layers(layers, stages)) == want


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="3 pipeline stages for a model of 2 layers"):
        stage_layers(2, 3)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 8))
def test_microbatches_keep_order_and_are_never_empty(tokens, count):
    work = list(range(len(tokens)))
    cut = split_microbatches(work, count, tokens)
    assert [w for mb in cut for w in mb] == work
    assert all(cut)
    assert len(cut) <= min(count, len(work))


def test_microbatches_balance_tokens():
    # 8 decodes of 1 token into 4 microbatches: 2 each
    assert [len(m) for m in split_microbatches(list(range(8)), 4, [1] * 8)] == [2, 2, 2, 2]
    # one long prefill then decodes: the prefill alone fills the first microbatch's share
    cut = split_microbatches(["p", "d1", "d2", "d3"], 2, [100, 1, 1, 1])
    assert cut == [["p"], ["d1", "d2", "d3"]]


def test_gpipe_timing_shows_the_bubble():
    # K = 2 stages, M = 4 equal microbatches of 1 s, no link: (M + K - 1) = 5 s,
    # bubble (K - 1) / (M + K - 1) = 1/5
    t = pipeline_timing([[1.0] * 4, [1.0] * 4], [0.0] * 4)
    assert t.makespan == 5.0
    assert t.bubble_ratio == pytest.approx(0.2)
    assert t.finish == ((1.0, 2.0, 3.0, 4.0), (2.0, 3.0, 4.0, 5.0))
    # a link of 0.5 s per microbatch delays stage 1 by it on every microbatch it waits for
    t = pipeline_timing([[1.0] * 2, [1.0] * 2], [0.5] * 2)
    assert t.finish == ((1.0, 2.0), (2.5, 3.5))
    assert t.transfer_s == 1.0
    # one stage: no bubble
    assert pipeline_timing([[1.0, 2.0]], [0.0, 0.0]).bubble_ratio == 0.0
