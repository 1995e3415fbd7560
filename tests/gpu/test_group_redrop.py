"""A member of a growing group changes the layers it keeps (gpu/group_grow.py `redrop_layers`):
only the layers it gains come back from its host copy and only those it drops now go to the
host; its host copy (then in pieces) still restores the whole model, and a peer's kept range
still fills a whole dropped range; the re-dropped model computes what the full model does."""

from __future__ import annotations

import itertools

import pytest
import torch

from gpu.group_grow import redrop_layers
from gpu.make_model import write_random_model
from gpu.metadata import build_step_inputs
from gpu.model import CausalLM
from gpu.stage_view import drop_layers, elem_range, restore_layers

LAYERS = 6


@pytest.fixture(scope="module")
def six_layer_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny-6l"), arch="llama", layers=LAYERS,
                              hidden=64, heads=4, kv_heads=2, vocab=320, seed=5)


def _load(path) -> CausalLM:
    return CausalLM.from_pretrained(path, num_kv_blocks=6, block_size=4)


def _layer_bytes(model: CausalLM, n: int) -> int:
    lb = model.arena.layout.layer_blocks
    return n * len(lb[0]) * model.arena.layout.block_elems * model.arena.buffer.element_size()


def _same_params(model: CausalLM, fresh: CausalLM) -> None:
    assert len(model.model.layers) == LAYERS and model.first_stage and model.last_stage
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("steps", [(range(3, 6), range(2, 4)), (range(3), range(2)),
                                   (range(3, 6), range(2, 4), range(4, 6))])
def test_a_redrop_copies_only_what_changes_and_restores_whole(six_layer_dir, steps):
    fresh = _load(six_layer_dir)
    model = _load(six_layer_dir)
    drop_layers(model, steps[0])
    for old, keep in itertools.pairwise(steps):
        state, restored, saved = redrop_layers(model, keep)
        assert restored == _layer_bytes(model, len(set(keep) - set(old)))
        assert saved == _layer_bytes(model, len(set(old) - set(keep)))
        assert state.keep == keep and len(model.model.layers) == len(keep)
        assert model.first_stage == (keep.start == 0) and model.last_stage == (keep.stop == 6)
    restore_layers(model)  # from the host copy, in pieces
    _same_params(model, fresh)


def test_a_redropped_stage_computes_the_full_models_layers_and_restores_from_a_peer(
        six_layer_dir):
    """0-2 | 3-5 becomes 0-1 | 2-3 | 4-5 on three copies (the head and member 1 re-dropped,
    member 2 dropped from whole): activations handed over by hand give the full model's
    logits; member 1 then restores from a peer's weights (a fill over its whole dropped
    ranges) and is the whole model again."""
    full, a, b, c = (_load(six_layer_dir) for _ in range(4))
    W = full.arena.weight_blocks
    tokens = list(range(30, 39))
    inputs = build_step_inputs([(tokens, 0, [W, W + 1, W + 2])], 4, "cpu", sample=[True])
    want = full.forward_stage(inputs.input_ids, inputs.positions, inputs.meta,
                              inputs.logits_indices)
    drop_layers(a, range(3))
    drop_layers(b, range(3, 6))
    redrop_layers(a, range(2))
    redrop_layers(b, range(2, 4))
    drop_layers(c, range(4, 6))
    h = None
    for stage in (a, b, c):
        table = [int(x) for x in stage.drop_state.view.usable[:3]]
        step = build_step_inputs([(tokens, 0, table)], 4, "cpu", sample=[True])
        h = stage.forward_stage(step.input_ids if h is None else h, step.positions, step.meta,
                                step.logits_indices)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)

    def from_peer(blocks: range, dst: torch.Tensor) -> None:
        dst.copy_(full.arena.buffer[elem_range(full.arena, blocks)])

    restore_layers(b, from_peer)
    _same_params(b, _load(six_layer_dir))


def test_the_redrop_bench_runs_and_checks_its_arguments(tmp_path, capsys):
    from bench.kunserve_redrop import main

    out = main(["--rounds", "1", "--layers", "3", "--hidden", "32",
                "--out", str(tmp_path / "r.json")])
    head = out["rows"]["head"]
    assert head["copied_bytes"]["incremental"] < head["copied_bytes"]["full"], head
    for bad, why in ((["--rounds", "0"], "--rounds"), (["--layers", "2"], "--layers"),
                     (["--hidden", "40"], "--hidden")):
        with pytest.raises(SystemExit):
            main(bad)
        assert why in capsys.readouterr().err
