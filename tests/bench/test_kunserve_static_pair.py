"""bench/kunserve.py's static 2-stage pipeline (`pipeline2`) gets the pool a KunServe pair gets
on the same instances, which is torch's (gpu/stage_view.py `group_pool_blocks`, mirrored without
torch by sim/arena_layout.py): the two pools plus the dropped decoder layers' arena blocks, not
the whole weights' bytes."""

from __future__ import annotations

import pytest

from bench.kunserve import static_pair_blocks
from engine.cluster.plan import stage_layers
from sim.arena_layout import group_pool_blocks, weight_blocks
from sim.profile import load_profile


@pytest.mark.parametrize("profile, one", [("llama3-8b-a10", None), ("llama3-8b-a100", 12300)])
def test_the_static_pair_has_a_kunserve_pair_s_pool(profile, one):
    p = load_profile(profile)
    one = one or p.num_blocks(16)
    layers = stage_layers(p.model.num_layers, 2)
    torch_pair = group_pool_blocks(p.model, 16, one + weight_blocks(p.model, 16), layers)
    assert static_pair_blocks(p.model, one, 16) == torch_pair


def test_the_a10_pair_is_round_13_s():
    p = load_profile("llama3-8b-a10")
    assert (p.num_blocks(16), static_pair_blocks(p.model, p.num_blocks(16), 16)) == (2469, 11626)
