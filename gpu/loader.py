"""Reading a Hugging Face model directory: which files hold the weights, which tensors a model
needs and with which shapes, and copying them (validated first) into place.

Weights come from `model.safetensors`, from the shards a `model.safetensors.index.json` lists,
or, with neither, from every `*.safetensors` in the directory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from gpu.config import ModelConfig

Shapes = dict[str, tuple[int, ...]]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# checkpoints often carry tensors no computation reads; anything else unexpected is an error
_HARMLESS = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def global_tensor_shapes(config: ModelConfig) -> Shapes:
    """The tensors outside the decoder layers, in arena order."""
    shapes: Shapes = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.norm.weight": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def layer_tensor_shapes(config: ModelConfig, layer: int) -> Shapes:
    """Decoder layer `layer`'s tensors, in arena order."""
    h, i = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    p = f"model.layers.{layer}."
    shapes: Shapes = {p + "input_layernorm.weight": (h,)}
    for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
        shapes[f"{p}self_attn.{proj}.weight"] = (out, h)
        if config.attention_bias:
            shapes[f"{p}self_attn.{proj}.bias"] = (out,)
    shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
    if config.o_proj_bias:
        shapes[p + "self_attn.o_proj.bias"] = (h,)
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes[p + "mlp.gate_proj.weight"] = (i, h)
    shapes[p + "mlp.up_proj.weight"] = (i, h)
    shapes[p + "mlp.down_proj.weight"] = (h, i)
    return shapes


def expected_tensor_shapes(config: ModelConfig) -> Shapes:
    """Every tensor the model reads, global ones first, then layer by layer."""
    shapes = global_tensor_shapes(config)
    for layer in range(config.num_layers):
        shapes.update(layer_tensor_shapes(config, layer))
    return shapes


def check_model_dir(model_dir: str | Path) -> None:
    """Fail early, naming the directory and the file, when a model directory is incomplete."""
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelLoadError(f"model directory {d} does not exist")
    for name in ("config.json", "tokenizer.json"):
        if not (d / name).is_file():
            raise ModelLoadError(f"model directory {d} has no {name}")
    weight_files(d)


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the weights, each checked to exist."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.is_file():
        return _shards_from_index(index)
    if (d / SINGLE_FILE).is_file():
        return [d / SINGLE_FILE]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {d} has no weights: no {SINGLE_FILE}, "
                             f"no {INDEX_FILE} and no other *.safetensors file")
    return files


def _shards_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index}: cannot read its weight_map: {e!r}") from e
    shards: dict[str, str] = {}  # shard file name -> first tensor it is listed for
    for tensor, shard in weight_map.items():
        shards.setdefault(shard, tensor)
    for shard, tensor in shards.items():
        if not (index.parent / shard).is_file():
            raise ModelLoadError(f"{index}: shard {shard!r} (listed for tensor {tensor!r}) "
                                 f"does not exist in {index.parent}")
    return [index.parent / shard for shard in sorted(shards)]


def _tensor_locations(files: list[Path]) -> tuple[dict[str, Path], Shapes]:
    """Which file holds each tensor, and its shape, without reading any data."""
    where: dict[str, Path] = {}
    shapes: Shapes = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    where[name] = path
                    info = f.get_slice(name)
                    shapes[name] = tuple(info.get_shape())
                    if info.get_dtype() not in _FLOAT_DTYPES:
                        raise ModelLoadError(f"{path}: tensor {name!r} has dtype "
                                             f"{info.get_dtype()}, expected a float type")
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{path}: not a readable safetensors file: {e}") from e
    return where, shapes


def _validate(config: ModelConfig, files: list[Path], where: dict[str, Path],
              found: Shapes) -> Shapes:
    expected = expected_tensor_shapes(config)
    searched = ", ".join(p.name for p in files)
    for name, shape in expected.items():
        if name not in where:
            raise ModelLoadError(f"{files[0].parent}: tensor {name!r} is missing "
                                 f"(searched {searched})")
        if found[name] != shape:
            raise ModelLoadError(f"{where[name]}: tensor {name!r} has shape {found[name]}, "
                                 f"expected {shape}")
    # a tied checkpoint may still store lm_head.weight (a copy of the embedding): unused
    unused = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extras = [n for n in where
              if n not in expected and n not in unused and not _HARMLESS.search(n)]
    if extras:
        raise ModelLoadError(
            f"{where[extras[0]]}: tensor {extras[0]!r} is not used by a {config.arch} model "
            f"with {config.num_layers} layers ({len(extras)} unexpected tensors in all); "
            "does config.json match the weights?")
    return expected


def check_weights(model_dir: str | Path, config: ModelConfig) -> dict[str, Path]:
    """Check that every tensor the model needs exists with the right shape, reading no data;
    returns which file holds each one."""
    files = weight_files(model_dir)
    where, found = _tensor_locations(files)
    return {name: where[name] for name in _validate(config, files, where, found)}


def copy_weights(locations: dict[str, Path],
                 destination: Callable[[str], torch.Tensor]) -> None:
    """Copy each tensor into `destination(name)`, converting dtype and device, one file at a
    time and one tensor at a time (host memory holds one tensor, not the checkpoint)."""
    by_file: dict[Path, list[str]] = {}
    for name, path in locations.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                destination(name).copy_(f.get_tensor(name))


def load_weights(model_dir: str | Path, config: ModelConfig,
                 destination: Callable[[str], torch.Tensor]) -> None:
    """Validate, then copy: nothing is copied unless every tensor checks out."""
    copy_weights(check_weights(model_dir, config), destination)
