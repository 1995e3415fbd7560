"""Llama / Qwen2-family causal LM: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

One set of modules serves two attention cores: `forward` writes this step's K/V into the paged
cache in the device arena and attends through block tables (serving); `forward_dense` runs causal
SDPA over whole [B, S] batches with no cache (training the shipped model, and a check).
Module and parameter names follow Hugging Face, so `named_parameters()` are checkpoint names.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from gpu.arena import DeviceArena
from gpu.attention import AttentionBackend, paged_attention, plan_decode, write_kv
from gpu.config import DTYPES, ModelConfig
from gpu.loader import check_model_dir, check_weights, copy_weights
from gpu.metadata import AttentionMetadata
from gpu.rope import RotaryEmbedding, apply_rope

# (layer, q [*N, Hq, D], k [*N, Hkv, D], v [*N, Hkv, D]) -> o [*N, Hq, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_META = torch.device("meta")


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the normalisation computed in float32 as Hugging Face does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, device=_META))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _linear(d_in: int, d_out: int, bias: bool) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=bias, device=_META)


class Attention(nn.Module):
    """Projections and RoPE around an attention core supplied by the caller."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        h, q_out = config.hidden_size, config.num_heads * config.head_dim
        kv_out = config.num_kv_heads * config.head_dim
        self.q_proj = _linear(h, q_out, config.attention_bias)
        self.k_proj = _linear(h, kv_out, config.attention_bias)
        self.v_proj = _linear(h, kv_out, config.attention_bias)
        self.o_proj = _linear(q_out, h, config.o_proj_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: AttendFn) -> torch.Tensor:
        lead = x.shape[:-1]  # x: [*N, hidden]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)  # [*N, Hq, D]
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)  # [*N, Hkv, D]
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        o = attend(self.layer, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(o.reshape(*lead, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = _linear(h, i, False), _linear(h, i, False)
        self.down_proj = _linear(i, h, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: AttendFn) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """Hugging Face's `model.*`: the embedding, the layers and the final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # a given weight skips Embedding's own init: on the meta device its normal_ imports
        # torch._dynamo, 4 s of every start-up here
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
            config.vocab_size, config.hidden_size, device=_META))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole model. Build it with `from_pretrained` (serving: weights in a DeviceArena) or
    `init_random` (training: ordinary parameters, dense forward only)."""

    def __init__(self, config: ModelConfig, *, rope_device: str | torch.device = "cpu",
                 attention_backend: AttentionBackend = "torch") -> None:
        super().__init__()
        if attention_backend not in ("torch", "triton"):
            raise ValueError(f"attention_backend must be 'torch' or 'triton', "
                             f"got {attention_backend!r}")
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = None if config.tie_word_embeddings else _linear(
            config.hidden_size, config.vocab_size, False)
        self.rotary = RotaryEmbedding(config, rope_device)
        self.scale = config.head_dim ** -0.5
        self.attention_backend: AttentionBackend = attention_backend
        self.arena: DeviceArena | None = None
        self._kv: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        self.first_stage = self.last_stage = True
        """A pipeline stage (`from_pretrained(layers=...)`) that is not first takes hidden
        states instead of token ids; one that is not last returns hidden states, not logits."""

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, *, device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None, num_kv_blocks: int, block_size: int = 16,
        attention_backend: AttentionBackend = "torch", layers: range | None = None,
    ) -> CausalLM:
        """Validate the directory and weights, then load them into a new DeviceArena.
        dtype None: float32 on CPU, the checkpoint's dtype on CUDA. `layers` (a contiguous
        range) makes a pipeline stage: only those decoder layers, renumbered from 0, with an
        arena whose KV blocks hold just their KV."""
        check_model_dir(model_dir)
        full = ModelConfig.from_dir(model_dir)
        locations = check_weights(model_dir, full)
        config, first = full, 0
        if layers is not None and layers != range(full.num_layers):
            config, first = attrs.evolve(full, num_layers=len(layers)), layers.start
            locations = {n: p for n, p in locations.items() if _stage_name(n, layers)}
        device = torch.device(device)
        if dtype is None:
            dtype = torch.float32 if device.type == "cpu" else config.dtype
        arena = DeviceArena(config, num_kv_blocks=num_kv_blocks, block_size=block_size,
                            dtype=dtype, device=device)
        copy_weights(locations, lambda name: arena.weight(_stage_name(name, layers) or name))
        model = cls(config, rope_device=device, attention_backend=attention_backend)
        model._replace_parameters(lambda name, _: arena.weight(name), requires_grad=False)
        model.arena = arena
        model._kv = tuple(arena.layer_kv(i) for i in range(config.num_layers))
        model.first_stage = first == 0
        model.last_stage = first + config.num_layers == full.num_layers
        return model.eval()

    @classmethod
    def init_random(cls, config: ModelConfig, *, seed: int,
                    dtype: torch.dtype = torch.float32) -> CausalLM:
        """Trainable parameters drawn like Hugging Face's init: normal(0, 0.02) for linears,
        biases and embeddings, ones for norms. Drawn in float32 in a fixed order, so a seed
        gives the same values (before rounding) in every dtype."""
        gen = torch.Generator().manual_seed(seed)

        def draw(name: str, meta: torch.Tensor) -> torch.Tensor:
            t = torch.empty(meta.shape, dtype=torch.float32)
            if name.endswith("norm.weight"):
                return t.fill_(1.0).to(dtype)
            return t.normal_(0.0, 0.02, generator=gen).to(dtype)

        model = cls(config)
        model._replace_parameters(draw, requires_grad=True)
        return model

    def _replace_parameters(self, make: Callable[[str, torch.Tensor], torch.Tensor],
                            requires_grad: bool) -> None:
        for name, param in list(self.named_parameters()):
            owner_name, _, leaf = name.rpartition(".")
            owner = self.get_submodule(owner_name)
            owner._parameters[leaf] = nn.Parameter(make(name, param), requires_grad=requires_grad)

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write model.safetensors (Hugging Face names) and config.json."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # clone: arena weights share one storage, which safetensors refuses to save
        tensors = {n: p.detach().to("cpu").clone() for n, p in self.named_parameters()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        dtype = next(iter(tensors.values())).dtype
        dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
        config = attrs.evolve(self.config, torch_dtype=dtype_name)
        (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
        return out

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attend: AttendFn) -> torch.Tensor:
        """input_ids, positions: [*N] -> hidden states before the final norm: [*N, hidden].
        A stage after the first gets hidden states [*N, hidden] in place of ids."""
        h = self.model.embed_tokens(input_ids) if self.first_stage else input_ids
        cos, sin = self.rotary(positions, h.dtype)  # [*N, 1, D]
        for layer in self.model.layers:
            h = layer(h, cos, sin, attend)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [*N, hidden] -> float32 logits [*N, vocab]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.model.norm(h), weight).float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """One serving step over the paged cache.

        input_ids, positions: [T] int64 (prefill chunks first, then decodes, as in `meta`);
        logits_indices: [S'] int64 rows of the batch to compute logits for -> [S', vocab] float32.
        """
        return self.forward_stage(input_ids, positions, meta, logits_indices)

    @torch.inference_mode()
    def forward_stage(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      logits_indices: torch.Tensor) -> torch.Tensor:
        """This stage's layers over the paged cache. x: token ids [T] on the first stage, else
        the previous stage's hidden states [T, hidden]; returns logits [S', vocab] float32 on
        the last stage, else hidden states [T, hidden] for the next. A whole model is both."""
        if self.arena is None:
            raise RuntimeError("the paged forward needs a model loaded with from_pretrained "
                               "(init_random models have no KV cache; use forward_dense)")

        plan = None
        if self.attention_backend == "torch" and meta.num_decodes:
            s = meta.num_prefills
            plan = plan_decode(meta.block_tables[s:], meta.seq_lens_host[s:],
                               self.arena.block_size)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = self._kv[layer]  # [num_blocks, block_size, Hkv, D]
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            return paged_attention(q, k_cache, v_cache, meta, self.scale,
                                   self.attention_backend, decode_plan=plan, k_new=k, v_new=v)

        h = self._hidden(x, positions, attend)  # [T, hidden]
        return self._logits(h[logits_indices]) if self.last_stage else h

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Causal attention over whole sequences, no cache: [B, S] -> [B, S, vocab] float32."""
        batch, seq = input_ids.shape
        positions = torch.arange(seq, device=input_ids.device).expand(batch, seq)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
            # [B, S, H, D] -> [B, H, S, D] and back
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True, scale=self.scale, enable_gqa=True)
            return o.transpose(1, 2)

        return self._logits(self._hidden(input_ids, positions, attend))


def _stage_name(name: str, layers: range | None) -> str | None:
    """A checkpoint tensor's name in a stage holding `layers` (its layers renumbered from 0),
    or None when the stage does not hold it. The global tensors are in every stage."""
    if layers is None or not name.startswith("model.layers."):
        return name
    index, _, rest = name[len("model.layers."):].partition(".")
    return f"model.layers.{int(index) - layers.start}.{rest}" if int(index) in layers else None
