"""A torch engine built with a `cost_profile` seeds the Eq. 1-3 fits of every pipeline group it
leads from that profile (§4.3's offline profiling): `shunter/backends.py` hands the fitted cost
model to the runner, `KunServeTorchRunner._group` seeds a new layer split's stage fits with the
profile's whole-model prediction times each stage's layer share, and a later group of the same
split goes on from the same fits. Without a profile the first group starts unfitted."""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from engine.cluster.drop_plan import GroupPlan
from engine.cost_model import BatchShape

PROFILE = Path(__file__).resolve().parents[2] / "bench/results/kunserve_lookahead_tiny_profile.json"
"""A profile fitted on this machine (`shunter profile fit`, issue16_torch_round3.md); its
coefficients are reused here for the test's model shapes (only the wiring is under test)."""


def test_a_profile_seeds_the_groups_stage_fits(tmp_path):
    from engine.config import EngineConfig
    from gpu.make_model import write_random_model
    from shunter.backends import build_backend

    model = write_random_model(tmp_path / "m", arch="llama", layers=4, hidden=64, heads=4,
                               kv_heads=2, vocab=320, seed=7)
    data = json.loads(PROFILE.read_text())
    data["model"].update(num_layers=4, hidden_size=64, num_kv_heads=2, head_dim=16,
                         num_heads=4, vocab_size=320, intermediate_size=176)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(data))
    config = EngineConfig(model=model, device="cpu", threads=1, num_blocks=24, block_size=4,
                          cpu_swap_blocks=0, cost_profile=profile)
    backend = build_backend(config)
    runner = backend.runner
    try:
        assert runner.cost_model is backend.cost_model is not None
        runner._load()
        plan = GroupPlan(group_id=1, members=(0, 1), layers=(range(1), range(1, 4)))
        group = runner._group(plan, ())
        fits = group.fits
        assert fits.fitted, "a group led with a profile starts fitted (no step has run)"
        assert runner._group(plan, ()).fits is fits  # the same split goes on from them
        chunks = [(0, 48), (100, 1), (40, 1), (200, 1)]
        whole = backend.cost_model.predict_ms(BatchShape.of(chunks))
        stages = [f.batch_ms(chunks) for f in fits.fits]
        # the profile's scale (Eq. 1-3 fitted to its predictions on random microbatches: not
        # its exact form), split by each stage's share of the layers, 1 of 4 and 3 of 4
        assert 0.5 * whole < sum(stages) < 2 * whole, (stages, whole)
        assert 2.5 < stages[1] / stages[0] < 3.5, stages
    finally:
        runner.close()

    alone = build_backend(attrs.evolve(config, cost_profile=None)).runner
    try:
        alone._load()
        assert alone.cost_model is None
        assert not alone._group(plan, ()).fits.fitted
    finally:
        alone.close()
