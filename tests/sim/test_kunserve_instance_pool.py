"""An instance's KV pool on the simulator is what the torch backend's arena leaves in the same
memory: the usable bytes in whole blocks, less the blocks the weights take there (the global
tensors from block 0, then each decoder layer from its own block boundary, gpu/arena.py
`plan_layout`). Before s32 the simulator counted the unaligned weight bytes instead, so its pool
was larger than torch's (Llama-3-8B on the A10 profile: 2,501 blocks against 2,469).

The expected pool is the largest torch arena that fits: its weight blocks from `plan_layout`,
its KV blocks as many as the memory holds beside them."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from shunter.backends import build_backend
from sim.arena_layout import weight_blocks
from sim.profile import ModelShape, list_profiles, load_profile

BLOCK = 16


def _torch_config(model: ModelShape):
    from gpu.config import ModelConfig

    return ModelConfig(arch="llama", vocab_size=model.vocab_size, hidden_size=model.hidden_size,
                       intermediate_size=model.intermediate_size, num_layers=model.num_layers,
                       num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                       head_dim=model.head_dim, tie_word_embeddings=model.tie_word_embeddings)


def _dtype(torch, model: ModelShape):
    return {2: torch.bfloat16, 4: torch.float32}[model.dtype_bytes]


@pytest.mark.parametrize("name", list_profiles())
def test_the_pool_is_the_largest_torch_arena_that_fits(name):
    torch = pytest.importorskip("torch")
    from gpu.arena import block_nbytes, plan_layout

    p = load_profile(name)
    config, dtype = _torch_config(p.model), _dtype(torch, p.model)
    layout = plan_layout(config, BLOCK, dtype)
    assert weight_blocks(p.model, BLOCK) == layout.weight_blocks
    room = p.gpu_memory_gib * 2**30 * p.memory_utilization - p.activation_gib * 2**30
    block = block_nbytes(config, BLOCK, dtype)
    n = p.num_blocks(BLOCK)
    # an arena of the weights and n KV blocks fits; one more KV block would not
    assert (layout.weight_blocks + n) * block <= room < (layout.weight_blocks + n + 1) * block


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_weights_in_blocks_follow_the_alignment_of_an_odd_shape(block_size):
    """Tensors whose sizes are not 256-byte multiples: each one's padding counts, as
    `plan_layout` places them."""
    torch = pytest.importorskip("torch")
    from gpu.arena import plan_layout

    odd = ModelShape(name="odd", num_layers=3, hidden_size=72, intermediate_size=200,
                     num_heads=3, num_kv_heads=1, head_dim=24, vocab_size=1001,
                     tie_word_embeddings=True, dtype_bytes=4)
    layout = plan_layout(_torch_config(odd), block_size, torch.float32)
    assert weight_blocks(odd, block_size) == layout.weight_blocks


def test_the_sim_backend_gets_that_pool():
    b = build_backend(EngineConfig(backend="sim", profile="llama3-8b-a10"))
    # 24 GB x 0.9 less the activations, in 2 MiB blocks, less 1,003 + 32 x 209 weight blocks
    assert b.runner.num_blocks == 2469
