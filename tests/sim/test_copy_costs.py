"""Copy costs grounded in FastSwitch's figures (issue 13 items 8, 9): the numbers follow from the
paper's, every shipped profile names where its link comes from, and the A10 profile's KV pool is
24 GB minus weights and activations."""

from __future__ import annotations

import pytest

from sim.arena_layout import weight_blocks
from sim.copy_costs import PCIE4_X16, scaled
from sim.profile import list_profiles, load_profile


def test_the_per_call_cost_is_the_papers_dispatch_share_of_a_10us_copy():
    # dispatch / (dispatch + 10 us) = 92.5%  ->  123.3 us; + 5.9 us so 128 KB takes 10 us
    assert PCIE4_X16.dispatch_us == pytest.approx(123.33 + (10 - 128 * 1024 / 32e9 * 1e6), abs=0.1)
    assert PCIE4_X16.copy_s(1, 128 * 1024) * 1e6 == pytest.approx(133.3, abs=0.2)
    assert 90 < PCIE4_X16.dispatch_us - 5.9 < 190           # inside the paper's 90-95% range
    half, double = scaled(PCIE4_X16, 0.5), scaled(PCIE4_X16, 2.0)
    assert (half.dispatch_us, double.dispatch_us) == pytest.approx(
        (PCIE4_X16.dispatch_us / 2, PCIE4_X16.dispatch_us * 2))
    assert half.bandwidth_gb_per_s == PCIE4_X16.bandwidth_gb_per_s == 32.0


@pytest.mark.parametrize("name", list_profiles())
def test_every_shipped_profile_names_the_source_of_its_copy_costs(name):
    link = load_profile(name).link
    assert "FastSwitch §2.2" in link.source or "measured" in link.source


def test_the_a10_profile_is_derived_from_the_a40_and_sized_to_24_gb():
    p = load_profile("llama3-8b-a10")
    assert "A40" in p.source and "696/600" in p.source and "149.7/125" in p.source
    weights = p.model.weight_bytes
    assert 16.0e9 < weights < 16.1e9                       # Llama-3-8B in fp16
    kv = p.num_blocks(16) * p.model.block_bytes(16)
    usable = 24e9 * 0.9
    # the weights as the torch arena holds them: 7,691 whole blocks (sim/arena_layout.py)
    arena = weight_blocks(p.model, 16) * p.model.block_bytes(16)
    assert 0 <= usable - arena - p.activation_gib * 2**30 - kv < p.model.block_bytes(16)
    assert 0 < p.activation_gib < 1.0
    # slower than the A100 profile of the same model, by the bandwidth gap at decode
    a100 = load_profile("llama3-8b-a100")
    assert 2.5 < p.cost.a_ms / a100.cost.a_ms < 4.0
