"""write_random_model: deterministic bytes, Hugging Face-like init, options, and argument errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.errors import ConfigError
from gpu.make_model import write_random_model
from gpu.tokenizer import Tokenizer

FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")


def make(out: Path, **overrides: Any) -> Path:
    args: dict[str, Any] = dict(arch="qwen2", layers=2, hidden=32, heads=4, kv_heads=2,
                                vocab=300, seed=0)
    args.update(overrides)
    return write_random_model(out, **args)


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a, b = make(tmp_path / "a"), make(tmp_path / "b")
    c = make(tmp_path / "c", seed=1)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_init_like_hugging_face(tmp_path: Path) -> None:
    tensors = load_file(make(tmp_path, hidden=64, vocab=2000) / "model.safetensors")
    assert torch.equal(tensors["model.norm.weight"], torch.ones(64))
    assert torch.equal(tensors["model.layers.1.input_layernorm.weight"], torch.ones(64))
    embed = tensors["model.embed_tokens.weight"]
    assert abs(embed.std().item() - 0.02) < 0.001 and abs(embed.mean().item()) < 0.001
    bias = tensors["model.layers.0.self_attn.k_proj.bias"]  # qwen2: random q/k/v biases
    assert bias.shape == (32,) and bias.abs().min() > 0
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors
    assert "lm_head.weight" in tensors  # untied by default
    assert not torch.equal(tensors["lm_head.weight"], embed)


def test_options(tmp_path: Path) -> None:
    d = make(tmp_path, arch="llama", dtype="bfloat16", tie_embeddings=True, intermediate=40,
             max_position_embeddings=512)
    tensors = load_file(d / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert "model.layers.0.self_attn.q_proj.bias" not in tensors
    assert tensors["model.layers.0.mlp.up_proj.weight"].shape == (40, 32)
    config = json.loads((d / "config.json").read_text())
    assert (config["torch_dtype"], config["tie_word_embeddings"]) == ("bfloat16", True)
    assert (config["max_position_embeddings"], config["intermediate_size"]) == (512, 40)
    assert config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("vocab", [259, 300, 1000])
def test_tokenizer_has_exactly_vocab_ids(tmp_path: Path, vocab: int) -> None:
    tok = Tokenizer.from_dir(make(tmp_path, vocab=vocab))
    assert tok.vocab_size == vocab
    assert tok.eos_token_ids == (1,)
    assert tok.decode(tok.encode("make_model ✓")) == "make_model ✓"


def test_transformers_loads_it(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    d = make(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.num_key_value_heads == 2 and model.config.vocab_size == 300
    generation = transformers.GenerationConfig.from_pretrained(d)
    assert (generation.bos_token_id, generation.eos_token_id) == (0, 1)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"vocab": 258}, "--vocab 258 is too small: the byte-level tokenizer needs 256 byte ids, 2 "
                     "special tokens and at least one merge (--vocab 259 or more)"),
    ({"arch": "gpt2"}, "--arch gpt2: not llama or qwen2"),
    ({"heads": 3}, "--hidden 32 is not divisible by --heads 3"),
    ({"heads": 4, "kv_heads": 3}, "--heads 4 is not divisible by --kv-heads 3"),
    ({"dtype": "int8"}, "--dtype int8: not one of float32, bfloat16, float16"),
])
def test_bad_arguments(tmp_path: Path, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        make(tmp_path, **overrides)
    assert str(info.value) == message
    assert not (tmp_path / "model.safetensors").exists()
