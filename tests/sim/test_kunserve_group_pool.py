"""A KunServe group's KV pool on the simulator is what the torch backend's group has: the
members' own pools plus, for each member past the first, one copy of the decoder layers' arena
blocks (each layer from its own block boundary, gpu/arena.py `plan_layout`). The embeddings, LM
head and final norm stay on every member (gpu/stage_view.py `kept_weight_ranges`), so they free
nothing: before s31's follow-up the simulator counted the whole weights (Llama-3-8B: 7,658
blocks a member, against torch's 6,688).

The expected pool is computed here from the model's shapes, then held equal to the torch
group's (`group_pool_blocks`, built from the same shapes), to what the simulator's group
manager gives a forming group's head, and to what its monitor plans with."""

from __future__ import annotations

import anyio
import pytest
import trio
import trio.testing

from engine.config import EngineConfig
from policies import policy_path
from shunter.cluster.cluster import Cluster
from sim.arena_layout import freed_blocks, global_blocks, group_pool_blocks, layer_blocks
from sim.profile import load_profile
from tests.sim.kunserve_burst import ends_of, start_burst

BLOCK = 16


def _layer_blocks_from_shapes(model, block_size: int) -> int:
    """One decoder layer's tensors (two norms, q/k/v/o, gate/up/down) in whole KV blocks."""
    h, i = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    tensors = [h, h, q * h, kv * h, kv * h, h * q, i * h, i * h, h * i]
    # every tensor a multiple of 256 bytes: the arena's alignment adds nothing
    assert all(n * model.dtype_bytes % 256 == 0 for n in tensors)
    block_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim \
        * model.dtype_bytes * block_size
    return -(-sum(tensors) * model.dtype_bytes // block_bytes)


def _expected_pool(model, pools: list[int]) -> int:
    return sum(pools) + (len(pools) - 1) * model.num_layers \
        * _layer_blocks_from_shapes(model, BLOCK)


def _torch_config(model):
    from gpu.config import ModelConfig

    return ModelConfig(arch="llama", vocab_size=model.vocab_size, hidden_size=model.hidden_size,
                       intermediate_size=model.intermediate_size, num_layers=model.num_layers,
                       num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                       head_dim=model.head_dim, tie_word_embeddings=model.tie_word_embeddings)


def _split(num_layers: int, k: int) -> tuple[range, ...]:
    return tuple(range(j * num_layers // k, (j + 1) * num_layers // k) for j in range(k))


@pytest.mark.parametrize("profile", ["llama3-8b-a10", "llama2-7b-a100"])
def test_uneven_splits_get_the_torch_groups_smaller_pool(profile):
    """Every split of 2-7 members, even or not, and a split by hand (the head keeping more):
    the simulator's count (sim/arena_layout.py) is torch's stage capacity. An uneven one wastes
    what its stride leaves over (Llama-3-8B in 3, 2,469 blocks each: 13,714, not 20,783)."""
    torch = pytest.importorskip("torch")
    from gpu.arena import plan_layout
    from gpu.stage_view import group_pool_blocks as torch_pool

    model = load_profile(profile).model
    config, L = _torch_config(model), model.num_layers
    for base in (300, 2469):
        total = plan_layout(config, BLOCK, torch.bfloat16).weight_blocks + base
        for layers in [_split(L, k) for k in range(2, 8)] + [(range(0, 20), range(20, L))]:
            assert group_pool_blocks(model, BLOCK, total, layers) == torch_pool(
                config, BLOCK, torch.bfloat16, total, layers), (base, layers)


@pytest.mark.parametrize("profile", ["llama3-8b-a10", "llama2-7b-a100"])
def test_the_group_pool_is_the_torch_groups(profile):
    torch = pytest.importorskip("torch")
    from gpu.arena import plan_layout
    from gpu.config import ModelConfig
    from gpu.stage_view import group_pool_blocks

    model = load_profile(profile).model
    config = ModelConfig(arch="llama", vocab_size=model.vocab_size,
                         hidden_size=model.hidden_size,
                         intermediate_size=model.intermediate_size, num_layers=model.num_layers,
                         num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                         head_dim=model.head_dim, tie_word_embeddings=model.tie_word_embeddings)
    layout = plan_layout(config, BLOCK, torch.bfloat16)
    assert model.dtype_bytes == torch.bfloat16.itemsize
    assert layer_blocks(model, BLOCK) == _layer_blocks_from_shapes(model, BLOCK)
    assert {len(r) for r in layout.layer_blocks} == {layer_blocks(model, BLOCK)}
    assert global_blocks(model, BLOCK) == len(layout.global_blocks)
    base, L = 2501, model.num_layers
    total = layout.weight_blocks + base
    for k in (2, 4):  # even splits: what every bench window forms
        split = tuple(range(j * L // k, (j + 1) * L // k) for j in range(k))
        torch_pool = group_pool_blocks(config, BLOCK, torch.bfloat16, total, split)
        assert torch_pool == _expected_pool(model, [base] * k)
        assert torch_pool == k * base + (k - 1) * freed_blocks(model, BLOCK)


async def _burst(instances: int = 2, n: int = 40):
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300,
                          policy=policy_path("kunserve_drop"))
    async with Cluster.start(config, instances=instances, kind="inprocess") as cluster:
        done = []
        with anyio.fail_after(120):  # virtual seconds: a lost request fails here
            async with anyio.create_task_group() as tg:
                start_burst(tg, cluster, done, n, max_tokens=60)
            snap = await cluster.inspect()
        return ends_of(done), snap, cluster.groups


def test_a_simulated_group_gets_that_pool():
    ends, snap, groups = trio.run(_burst, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(set(ends)) == [("length", 60)] and len(ends) == 40
    model = groups.model
    expected = _expected_pool(model, [300, 300])  # Llama-3-8B: 600 + 32 x 209 = 7,288
    formed = [e for e in groups.counters.events if e["event"] == "group"]
    assert formed and [e["pool_blocks"] for e in formed] == [expected] * len(formed)
    assert groups.monitor.weight_blocks == expected - 600  # the planner sizes groups alike
    head = next(iter(groups.groups))  # kunserve_drop never restores: still grouped
    assert snap.snapshots[head].scheduler.total_blocks == expected


def test_a_simulated_group_of_three_gets_torchs_pool():
    """Three instances and a larger burst: one group of three (layers 10 | 11 | 11, each
    member's kept layers 16 apart), whose pool is torch's for that split (9,376 blocks), not
    900 + 2 x 6,688."""
    torch = pytest.importorskip("torch")
    from gpu.arena import plan_layout
    from gpu.stage_view import group_pool_blocks as torch_pool

    ends, _, groups = trio.run(_burst, 3, 60, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(set(ends)) == [("length", 60)] and len(ends) == 60
    config = _torch_config(groups.model)
    total = plan_layout(config, BLOCK, torch.bfloat16).weight_blocks + 300
    formed = [e for e in groups.counters.events if e["event"] == "group"]
    threes = [e for e in formed if len(e["members"]) == 3]
    assert threes, formed
    (g,) = groups.groups.values()
    expected = torch_pool(config, BLOCK, torch.bfloat16, total, g.layers)
    assert [e["pool_blocks"] for e in threes] == [expected] * len(threes)
    assert expected < 900 + 2 * 6688
