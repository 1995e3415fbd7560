"""The model's shape, read from a Hugging Face `config.json` (Llama and Qwen2 families).

Both the legacy keys (`rope_theta`, `rope_scaling`) and the newer `rope_parameters` dict are
read; `to_hf_dict` writes the legacy keys, which every transformers version understands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import attrs
import torch

from engine.errors import ModelLoadError

Arch = Literal["llama", "qwen2"]

_ARCHITECTURES: dict[str, Arch] = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_CLASS_OF: dict[Arch, str] = {arch: cls for cls, arch in _ARCHITECTURES.items()}
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


@attrs.frozen(kw_only=True)
class RopeScaling:
    """How RoPE frequencies are stretched for a longer context than the model was trained on."""

    kind: Literal["linear", "llama3"]
    """`linear` divides every frequency by `factor`; `llama3` divides only the low ones and
    interpolates in between (Llama 3.1)."""
    factor: float
    low_freq_factor: float = 1.0
    """llama3 only: wavelengths above original_max_position_embeddings / this are scaled."""
    high_freq_factor: float = 4.0
    """llama3 only: wavelengths below original_max_position_embeddings / this are kept."""
    original_max_position_embeddings: int = 8192
    """llama3 only: the context length of pretraining."""


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Everything about the model's shape that loading and running it needs."""

    arch: Arch
    """Model family: `llama` or `qwen2` (Qwen2 adds q/k/v biases)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding matrix (no `lm_head.weight` tensor)."""
    attention_bias: bool = False
    """q/k/v projections have biases (always for Qwen2; Llama's `attention_bias` also gives
    o_proj one)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    """The checkpoint's dtype name: float32, bfloat16 or float16."""

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads={self.num_heads} is not a multiple of "
                                 f"num_kv_heads={self.num_kv_heads}")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    @property
    def o_proj_bias(self) -> bool:
        """Llama's `attention_bias` covers o_proj too; Qwen2's o_proj never has one."""
        return self.attention_bias and self.arch == "llama"

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"model directory {model_dir} has no config.json")
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot read JSON: {e}") from e
        return cls.from_hf_dict(d, str(path))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        arch = _arch_of(d, source)
        _check_supported(d, source)
        hidden, heads = _int(d, "hidden_size", source), _int(d, "num_attention_heads", source)
        rope_theta, scaling = _rope(d, source)
        return cls(
            arch=arch,
            vocab_size=_int(d, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_int(d, "intermediate_size", source),
            num_layers=_int(d, "num_hidden_layers", source),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos(d.get("eos_token_id"), source),
            torch_dtype=_dtype_name(d, source),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers loads as LlamaForCausalLM / Qwen2ForCausalLM."""
        eos = list(self.eos_token_ids)
        d: dict[str, Any] = {
            "architectures": [_CLASS_OF[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": _scaling_dict(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "torch_dtype": self.torch_dtype,
            "use_cache": True,
        }
        if self.arch == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        else:
            d["use_sliding_window"] = False
        return d


def _arch_of(d: dict[str, Any], source: str) -> Arch:
    archs = d.get("architectures") or []
    if archs:
        if archs[0] not in _ARCHITECTURES:
            raise ModelLoadError(f"{source}: unsupported architecture {archs[0]!r} "
                                 f"(supported: {', '.join(_ARCHITECTURES)})")
        return _ARCHITECTURES[archs[0]]
    model_type = d.get("model_type")
    if model_type not in _CLASS_OF:
        raise ModelLoadError(f"{source}: unsupported model_type {model_type!r} "
                             f"(supported: {', '.join(_CLASS_OF)})")
    return model_type


def _check_supported(d: dict[str, Any], source: str) -> None:
    """Reject options this implementation would otherwise silently ignore."""
    if d.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act {d['hidden_act']!r} is not supported "
                             "(only 'silu')")
    for key in ("mlp_bias", "use_sliding_window"):
        if d.get(key):
            raise ModelLoadError(f"{source}: {key}=true is not supported")


def _int(d: dict[str, Any], key: str, source: str) -> int:
    if key not in d:
        raise ModelLoadError(f"{source}: missing key {key!r}")
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"{source}: key {key!r} must be a positive integer, got {value!r}")
    return value


def _rope(d: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_parameters` (new style) or the legacy keys."""
    if isinstance(d.get("rope_parameters"), dict):
        key, params = "rope_parameters", d["rope_parameters"]
    else:
        key, params = "rope_scaling", d.get("rope_scaling")
    theta = float((params or {}).get("rope_theta", d.get("rope_theta", 10000.0)))
    if not params:
        return theta, None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise ModelLoadError(f"{source}: key {key!r} has rope type {kind!r}, which is not "
                             "supported (supported: none, 'linear', 'llama3')")
    if "factor" not in params:
        raise ModelLoadError(f"{source}: key {key!r} has no 'factor'")
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(params["factor"]))
    return theta, RopeScaling(
        kind=kind,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get(
            "original_max_position_embeddings", d.get("max_position_embeddings", 8192))),
    )


def _scaling_dict(s: RopeScaling | None) -> dict[str, Any] | None:
    if s is None:
        return None
    if s.kind == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}


def _eos(value: Any, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ModelLoadError(f"{source}: key 'eos_token_id' must be an int or a list of ints, "
                             f"got {value!r}")
    return tuple(ids)


def _dtype_name(d: dict[str, Any], source: str) -> str:
    name = d.get("torch_dtype") or d.get("dtype") or "float32"
    if name not in DTYPES:
        raise ModelLoadError(f"{source}: key 'torch_dtype' is {name!r}, expected one of "
                             f"{', '.join(DTYPES)}")
    return name
