"""ModelConfig from Hugging Face config dicts: both families, RoPE scaling, eos forms, the errors,
and that what `to_hf_dict` writes is what transformers reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpu.config import ModelConfig, RopeScaling
from shunter import ModelLoadError


def make_hf_dict(**overrides: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 128, "bos_token_id": 0,
        "eos_token_id": 1, "torch_dtype": "bfloat16",
    }
    d.update(overrides)
    return {k: v for k, v in d.items() if v is not None}


def test_llama_fields() -> None:
    c = ModelConfig.from_hf_dict(make_hf_dict())
    assert (c.arch, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 2, 4, 2, 16)
    assert (c.rope_theta, c.rope_scaling, c.rms_norm_eps) == (500000.0, None, 1e-5)
    assert (c.attention_bias, c.tie_word_embeddings, c.eos_token_ids) == (False, False, (1,))
    assert c.torch_dtype == "bfloat16"


def test_qwen2_has_attention_bias_and_explicit_head_dim() -> None:
    c = ModelConfig.from_hf_dict(make_hf_dict(architectures=["Qwen2ForCausalLM"],
                                              model_type="qwen2", head_dim=32,
                                              eos_token_id=[1, 7], tie_word_embeddings=True))
    assert (c.arch, c.attention_bias, c.o_proj_bias, c.head_dim) == ("qwen2", True, False, 32)
    assert c.eos_token_ids == (1, 7) and c.tie_word_embeddings


def test_model_type_used_without_architectures() -> None:
    c = ModelConfig.from_hf_dict(make_hf_dict(architectures=None, model_type="qwen2"))
    assert c.arch == "qwen2"


def test_defaults_when_optional_keys_are_absent() -> None:
    c = ModelConfig.from_hf_dict(make_hf_dict(num_key_value_heads=None, eos_token_id=None,
                                              torch_dtype=None, rope_theta=None))
    assert (c.num_kv_heads, c.eos_token_ids, c.torch_dtype, c.rope_theta) == (
        4, (), "float32", 10000.0)


@pytest.mark.parametrize(("key", "scaling", "expected"), [
    ("rope_scaling", {"type": "linear", "factor": 2.0}, RopeScaling(kind="linear", factor=2.0)),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
     RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=8192)),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1000.0}, None),
    ("rope_parameters", {"rope_type": "linear", "factor": 3.0, "rope_theta": 1000.0},
     RopeScaling(kind="linear", factor=3.0)),
])
def test_rope_scaling(key: str, scaling: dict[str, Any], expected: RopeScaling | None) -> None:
    c = ModelConfig.from_hf_dict(make_hf_dict(**{key: scaling}))
    assert c.rope_scaling == expected
    if key == "rope_parameters":
        assert c.rope_theta == 1000.0


def test_unsupported_rope_type_names_file_and_key() -> None:
    d = make_hf_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match=r"^/m/config.json: key 'rope_scaling' has rope "
                                             r"type 'yarn', which is not supported"):
        ModelConfig.from_hf_dict(d, "/m/config.json")


def test_unknown_architecture_names_file_and_value() -> None:
    d = make_hf_dict(architectures=["MambaForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"^/m/config.json: unsupported architecture "
                                             r"'MambaForCausalLM' \(supported: "):
        ModelConfig.from_hf_dict(d, "/m/config.json")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"hidden_size": None}, "c.json: missing key 'hidden_size'"),
    ({"num_hidden_layers": "2"}, "c.json: key 'num_hidden_layers' must be a positive integer, "
                                 "got '2'"),
    ({"eos_token_id": "x"}, "c.json: key 'eos_token_id' must be an int or a list of ints"),
    ({"torch_dtype": "int8"}, "c.json: key 'torch_dtype' is 'int8', expected one of"),
    ({"hidden_act": "gelu"}, "c.json: hidden_act 'gelu' is not supported"),
    ({"mlp_bias": True}, "c.json: mlp_bias=true is not supported"),
    ({"num_key_value_heads": 3}, "num_heads=4 is not a multiple of num_kv_heads=3"),
])
def test_invalid_values(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_hf_dict(make_hf_dict(**overrides), "c.json")
    assert str(info.value).startswith(message)


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_dir(tmp_path)
    assert str(info.value) == f"model directory {tmp_path} has no config.json"
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_dir(tmp_path)
    assert str(info.value).startswith(f"{tmp_path}/config.json: cannot read JSON: ")


@pytest.mark.parametrize("overrides", [
    {},
    {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "eos_token_id": [1, 2],
     "tie_word_embeddings": True},
    {"attention_bias": True, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                              "original_max_position_embeddings": 64}},
])
def test_round_trip_through_transformers(tmp_path: Path, overrides: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    config = ModelConfig.from_hf_dict(make_hf_dict(**overrides))
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[config.arch]
    assert (hf.num_hidden_layers, hf.num_key_value_heads, hf.head_dim, hf.vocab_size) == (
        config.num_layers, config.num_kv_heads, config.head_dim, config.vocab_size)
    assert hf.tie_word_embeddings == config.tie_word_embeddings
    rope = hf.rope_parameters
    assert rope["rope_theta"] == config.rope_theta
    assert rope["rope_type"] == (config.rope_scaling.kind if config.rope_scaling else "default")
