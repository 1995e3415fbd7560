"""Dropping a layer range in place (KunServe §4.1): the kept layers' KV is read where it was
(no copy), the freed weights become stage blocks, and restoring gives the model back."""

from __future__ import annotations

import pytest
import torch

from gpu.config import ModelConfig
from gpu.make_model import write_random_model
from gpu.metadata import build_step_inputs
from gpu.model import CausalLM
from gpu.stage_view import (
    StageView,
    drop_layers,
    group_pool_blocks,
    kept_weight_ranges,
    restore_layers,
    stride_layers,
)


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-4l")
    return write_random_model(out, arch="llama", layers=4, hidden=64, heads=4, kv_heads=2,
                              vocab=320, seed=3)


def test_stride_is_the_smallest_divisor_at_least_the_kept_count():
    assert [stride_layers(4, k) for k in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert [stride_layers(6, k) for k in (1, 2, 3, 4, 5)] == [1, 2, 3, 6, 6]
    with pytest.raises(ValueError):
        stride_layers(4, 0)


def _prefill(model: CausalLM, tokens: list[int], table: list[int]) -> torch.Tensor:
    inputs = build_step_inputs([(tokens, 0, table)], model.arena.block_size, "cpu",
                               sample=[True])
    return model.forward_stage(inputs.input_ids if model.first_stage else None, inputs.positions,
                               inputs.meta, inputs.logits_indices)


@pytest.mark.parametrize("keep", [range(2), range(2, 4), range(1, 3), range(3, 4)])
def test_kept_kv_is_read_in_place_and_freed_blocks_are_usable(four_layer_dir, keep):
    model = CausalLM.from_pretrained(four_layer_dir, num_kv_blocks=6, block_size=4)
    arena = model.arena
    W, T = arena.weight_blocks, arena.total_blocks
    table = [W + 4, W + 1, W + 3]
    tokens = list(range(5, 15))
    _prefill(model, tokens, table)
    before = arena.kv.clone()
    state = drop_layers(model, keep)
    view = state.view
    assert model.first_stage == (keep.start == 0) and model.last_stage == (keep.stop == 4)
    for i, layer in enumerate(keep):
        k_cache, v_cache = model._kv[i]
        for b in table:  # the kept KV is where it was: read through the new view, no copy
            assert torch.equal(k_cache[view.local_of_old(b)], before[b, layer, 0])
            assert torch.equal(v_cache[view.local_of_old(b)], before[b, layer, 1])
    # every usable stage block lies outside the weights still kept, and there are more of them
    # than the old pool had (the dropped weights and the other layers' KV became blocks)
    assert view.capacity > T - W
    kept_params = [p for layer in model.model.layers for p in layer.parameters()]
    kept_params += [model.model.embed_tokens.weight, model.model.norm.weight]
    for p in kept_params:
        lo = p.storage_offset()
        hi = lo + p.numel()
        for n in view.usable[::7]:
            s = view.first + int(n) * view.stride * view.unit
            assert hi <= s or s + len(keep) * view.unit <= lo
    assert state.freed_bytes > 0
    restore_layers(model)
    assert len(model.model.layers) == 4 and model.first_stage and model.last_stage
    fresh = CausalLM.from_pretrained(four_layer_dir, num_kv_blocks=6, block_size=4)
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), name


def test_a_two_stage_drop_computes_what_the_full_model_does(four_layer_dir):
    """Half the layers on each of two dropped copies, activations handed over by hand: the
    logits equal the full model's, for a prefill and a decode written into freed blocks."""
    full = CausalLM.from_pretrained(four_layer_dir, num_kv_blocks=6, block_size=4)
    a = CausalLM.from_pretrained(four_layer_dir, num_kv_blocks=6, block_size=4)
    b = CausalLM.from_pretrained(four_layer_dir, num_kv_blocks=6, block_size=4)
    W = full.arena.weight_blocks
    tokens = list(range(20, 29))
    want = _prefill(full, tokens, [W, W + 1, W + 2])
    drop_layers(a, range(2))
    sb = drop_layers(b, range(2, 4))
    # freed blocks only (not the old KV region): stage blocks that were dropped weights
    table_a = [int(x) for x in a.drop_state.view.usable[:3]]
    table_b = [int(x) for x in sb.view.usable[:3]]
    inputs = build_step_inputs([(tokens, 0, table_a)], 4, "cpu", sample=[True])
    h = a.forward_stage(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)
    inputs_b = build_step_inputs([(tokens, 0, table_b)], 4, "cpu", sample=[True])
    got = b.forward_stage(h, inputs_b.positions, inputs_b.meta, inputs_b.logits_indices)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    nxt = int(want.argmax())
    dec_full = build_step_inputs([([nxt], 9, [W, W + 1, W + 2])], 4, "cpu", sample=[True])
    want2 = full.forward_stage(dec_full.input_ids, dec_full.positions, dec_full.meta,
                               dec_full.logits_indices)
    dec_a = build_step_inputs([([nxt], 9, table_a)], 4, "cpu", sample=[True])
    h2 = a.forward_stage(dec_a.input_ids, dec_a.positions, dec_a.meta, dec_a.logits_indices)
    dec_b = build_step_inputs([([nxt], 9, table_b)], 4, "cpu", sample=[True])
    got2 = b.forward_stage(h2, dec_b.positions, dec_b.meta, dec_b.logits_indices)
    torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-5)


def test_group_pool_is_the_smallest_member_capacity(four_layer_dir):
    config = ModelConfig.from_dir(four_layer_dir)
    model = CausalLM.from_pretrained(four_layer_dir, num_kv_blocks=6, block_size=4)
    layout, T = model.arena.layout, model.arena.total_blocks
    layers = (range(2), range(2, 4))
    caps = [StageView(config, 4, T, kept_weight_ranges(layout, k), k).capacity for k in layers]
    assert group_pool_blocks(config, 4, torch.float32, T, layers) == min(caps)
