"""DeviceArena: the weight layout (whole-block layer ranges, no overlaps), the block-major KV view
(consecutive blocks are one contiguous byte range), and weights surviving the round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from gpu.arena import DeviceArena, block_nbytes, blocks_for_bytes, plan_layout
from gpu.config import ModelConfig
from gpu.loader import expected_tensor_shapes
from gpu.model import CausalLM


def make_config(**overrides: object) -> ModelConfig:
    fields = dict(arch="llama", vocab_size=300, hidden_size=64, intermediate_size=96,
                  num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


configs = st.builds(
    lambda arch, layers, kv, tied, vocab, inter: make_config(
        arch=arch, num_layers=layers, num_kv_heads=kv, tie_word_embeddings=tied,
        vocab_size=vocab, intermediate_size=inter, attention_bias=arch == "qwen2"),
    st.sampled_from(["llama", "qwen2"]), st.integers(1, 5), st.sampled_from([1, 2, 4]),
    st.booleans(), st.integers(259, 2000), st.integers(1, 300))


@settings(max_examples=60, deadline=None)
@given(config=configs, block_size=st.sampled_from([1, 2, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_layout_invariants(config: ModelConfig, block_size: int, dtype: torch.dtype) -> None:
    layout = plan_layout(config, block_size, dtype)
    assert layout.slots.keys() == expected_tensor_shapes(config).keys()
    # the global range, then every layer's range, back to back from block 0
    ranges = [layout.global_blocks, *layout.layer_blocks]
    assert ranges[0].start == 0 and len(ranges) == config.num_layers + 1
    assert all(a.stop == b.start and len(a) >= 1 for a, b in zip(ranges, ranges[1:]))
    assert layout.weight_blocks == ranges[-1].stop
    # every tensor lies inside its own range; tensors never overlap
    per_block = layout.block_elems
    spans = []
    for name, slot in layout.slots.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        r = layout.global_blocks if layer is None else layout.layer_blocks[layer]
        assert r.start * per_block <= slot.start
        assert slot.start + slot.numel <= r.stop * per_block, name
        spans.append((slot.start, slot.start + slot.numel))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_sizes_follow_the_formula() -> None:
    config = make_config()
    arena = DeviceArena(config, num_kv_blocks=5, block_size=8, dtype=torch.bfloat16)
    elems = 3 * 2 * 8 * 2 * 16
    assert arena.block_nbytes == elems * 2 == block_nbytes(config, 8, torch.bfloat16)
    assert arena.buffer.numel() == (arena.weight_blocks + 5) * elems
    assert arena.kv.shape == (arena.weight_blocks + 5, 3, 2, 8, 2, 16)
    assert arena.kv_block_ids == range(arena.weight_blocks, arena.weight_blocks + 5)
    assert blocks_for_bytes(config, 8, torch.bfloat16, 10 * elems * 2 + 7) == 10
    assert blocks_for_bytes(config, 8, torch.bfloat16, 5) == 0


def test_a_run_of_blocks_is_one_contiguous_byte_range() -> None:
    arena = DeviceArena(make_config(), num_kv_blocks=10, block_size=4)
    base, nbytes = arena.buffer.data_ptr(), arena.block_nbytes
    b, n = arena.kv_block_ids.start + 2, 5
    run = arena.kv[b:b + n]
    assert run.is_contiguous()
    assert run.data_ptr() == base + b * nbytes
    assert run.numel() * run.element_size() == n * nbytes
    # each layer's k/v of block b live inside block b's bytes
    for layer in range(3):
        k_cache, v_cache = arena.layer_kv(layer)
        assert k_cache.shape == (arena.total_blocks, 4, 2, 16)
        for cache in (k_cache, v_cache):
            start = cache[b].data_ptr()
            end = cache[b, -1, -1, -1].data_ptr() + cache.element_size()
            assert base + b * nbytes <= start < end <= base + (b + 1) * nbytes


def test_kv_writes_never_touch_weights(tiny_qwen2_dir: Path) -> None:
    model = CausalLM.from_pretrained(tiny_qwen2_dir, num_kv_blocks=6, block_size=4)
    arena = model.arena
    first_kv = arena.kv_block_ids.start
    assert first_kv == arena.weight_blocks
    last_weight_end = max(arena.weight(n).data_ptr() + arena.weight(n).numel() * 4
                          for n in arena.weight_names())
    assert last_weight_end <= arena.buffer.data_ptr() + first_kv * arena.block_nbytes
    before = arena.buffer[:first_kv * arena.layout.block_elems].clone()
    arena.kv[first_kv:] = 7.0
    assert torch.equal(arena.buffer[:first_kv * arena.layout.block_elems], before)


def test_weights_round_trip(tiny_qwen2_dir: Path) -> None:
    model = CausalLM.from_pretrained(tiny_qwen2_dir, num_kv_blocks=2, block_size=4)
    stored = load_file(tiny_qwen2_dir / "model.safetensors")
    assert sorted(model.arena.weight_names()) == sorted(stored)
    for name, tensor in stored.items():
        assert torch.equal(model.arena.weight(name), tensor), name
    # the model's parameters are those very views, not copies
    params = dict(model.named_parameters())
    assert params.keys() == stored.keys()
    for name, p in params.items():
        assert p.data_ptr() == model.arena.weight(name).data_ptr(), name


def test_layer_range_holds_exactly_that_layer(tiny_llama_dir: Path) -> None:
    model = CausalLM.from_pretrained(tiny_llama_dir, num_kv_blocks=2, block_size=4)
    arena = model.arena
    r = arena.layer_block_range(1)
    lo = arena.buffer.data_ptr() + r.start * arena.block_nbytes
    hi = arena.buffer.data_ptr() + r.stop * arena.block_nbytes
    for name in arena.weight_names():
        inside = lo <= arena.weight(name).data_ptr() < hi
        assert inside == name.startswith("model.layers.1."), name


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_kv_blocks >= 1 and block_size >= 1, got "
                                         "num_kv_blocks=0, block_size=16"):
        DeviceArena(make_config(), num_kv_blocks=0)
    with pytest.raises(KeyError, match="arena has no weight 'lm_head.bias'"):
        DeviceArena(make_config(), num_kv_blocks=1).weight("lm_head.bias")
