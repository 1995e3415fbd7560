"""Loading model directories: sharded and single-file weights, and every broken directory we
can name, each asserting the error type and its text (the file and the tensor)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu.config import ModelConfig
from gpu.loader import check_model_dir, expected_tensor_shapes, load_weights
from gpu.model import CausalLM
from shunter import ModelLoadError

UP_1 = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture
def model_dir(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama directory, free to break."""
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))


def _rewrite(d: Path, change: dict[str, torch.Tensor | None]) -> None:
    """Rewrite model.safetensors with tensors replaced (or removed, for None)."""
    tensors = load_file(d / "model.safetensors")
    for name, t in change.items():
        if t is None:
            tensors.pop(name)
        else:
            tensors[name] = t
    save_file(tensors, d / "model.safetensors")


def _shard(d: Path) -> dict[str, str]:
    """Split model.safetensors into two shards and an index; returns the weight map."""
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, d / shard)
        weight_map.update({n: shard for n in members})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def _load(d: Path) -> CausalLM:
    return CausalLM.from_pretrained(d, num_kv_blocks=2, block_size=4)


def _load_error(d: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        _load(d)
    return str(info.value)


def _weights(d: Path) -> dict[str, torch.Tensor]:
    config = ModelConfig.from_dir(d)
    out = {n: torch.empty(s) for n, s in expected_tensor_shapes(config).items()}
    load_weights(d, config, out.__getitem__)
    return out


def test_loads_exactly_the_stored_tensors(model_dir: Path) -> None:
    stored = load_file(model_dir / "model.safetensors")
    loaded = _weights(model_dir)
    assert loaded.keys() == stored.keys()
    for name, t in stored.items():
        assert torch.equal(loaded[name], t), name


def test_sharded_weights_load_the_same(model_dir: Path) -> None:
    before = _weights(model_dir)
    _shard(model_dir)
    after = _weights(model_dir)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_unindexed_safetensors_files_load(model_dir: Path) -> None:
    before = _weights(model_dir)
    _shard(model_dir)
    (model_dir / "model.safetensors.index.json").unlink()
    after = _weights(model_dir)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_index_naming_a_missing_shard(model_dir: Path) -> None:
    weight_map = _shard(model_dir)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    first = next(n for n, s in weight_map.items() if s == "model-00002-of-00002.safetensors")
    index = model_dir / "model.safetensors.index.json"
    assert _load_error(model_dir) == (
        f"{index}: shard 'model-00002-of-00002.safetensors' (listed for tensor {first!r}) "
        f"does not exist in {model_dir}")


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json"])
def test_missing_file(model_dir: Path, missing: str) -> None:
    (model_dir / missing).unlink()
    assert _load_error(model_dir) == f"model directory {model_dir} has no {missing}"


def test_no_weights(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    assert _load_error(model_dir) == (
        f"model directory {model_dir} has no weights: no model.safetensors, "
        "no model.safetensors.index.json and no other *.safetensors file")


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        check_model_dir(tmp_path / "nope")
    assert str(info.value) == f"model directory {tmp_path / 'nope'} does not exist"


def test_unknown_architecture(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    assert _load_error(model_dir).startswith(
        f"{model_dir}/config.json: unsupported architecture 'GPT2LMHeadModel' (supported: ")


def test_wrong_shape_names_file_tensor_and_shapes(model_dir: Path) -> None:
    _rewrite(model_dir, {UP_1: torch.zeros(32, 64)})
    assert _load_error(model_dir) == (f"{model_dir}/model.safetensors: tensor '{UP_1}' has shape "
                               "(32, 64), expected (192, 64)")


def test_missing_tensor_names_it_and_the_files_searched(model_dir: Path) -> None:
    _shard(model_dir)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shard = model_dir / index["weight_map"][UP_1]
    tensors = load_file(shard)
    del tensors[UP_1]
    save_file(tensors, shard)
    assert _load_error(model_dir) == (
        f"{model_dir}: tensor '{UP_1}' is missing (searched model-00001-of-00002.safetensors, "
        "model-00002-of-00002.safetensors)")


def test_harmless_extras_are_ignored(model_dir: Path, tiny_llama_dir: Path) -> None:
    _rewrite(model_dir, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    assert _load(model_dir).config == ModelConfig.from_dir(tiny_llama_dir)
    loaded, original = _weights(model_dir), _weights(tiny_llama_dir)
    assert loaded.keys() == original.keys()  # the extra is not among them
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor), name


def test_unexpected_tensor_is_an_error(model_dir: Path) -> None:
    extra = "model.layers.2.mlp.up_proj.weight"
    _rewrite(model_dir, {extra: torch.zeros(192, 64)})
    assert _load_error(model_dir).startswith(
        f"{model_dir}/model.safetensors: tensor '{extra}' is not used by a llama model with "
        "2 layers")


def test_integer_tensor_is_an_error(model_dir: Path) -> None:
    _rewrite(model_dir, {UP_1: torch.zeros(192, 64, dtype=torch.int32)})
    assert _load_error(model_dir) == (
        f"{model_dir}/model.safetensors: tensor '{UP_1}' has dtype I32, expected a float type")


def test_tied_checkpoint_may_keep_a_copy_of_lm_head(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (model_dir / "config.json").write_text(json.dumps(config))
    model = _load(model_dir)  # lm_head.weight is stored but unused
    assert model.lm_head is None
    assert "lm_head.weight" not in model.arena.weight_names()
