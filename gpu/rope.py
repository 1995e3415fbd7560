"""Rotary position embeddings (the rotate-half layout of Hugging Face Llama checkpoints), with
the `linear` and `llama3` frequency scalings."""

from __future__ import annotations

import math

import torch
from torch import nn

from gpu.config import ModelConfig, RopeScaling


def rope_inv_freq(config: ModelConfig, device: str | torch.device = "cpu") -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim / 2]."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    return _llama3(inv_freq, scaling)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions, computed in float32 then cast to the model dtype."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config, device), persistent=False)

    def forward(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [*N] -> cos, sin: [*N, 1, D] (the 1 broadcasts over heads)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [*N, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [*N, D]
        return angles.cos().to(dtype).unsqueeze(-2), angles.sin().to(dtype).unsqueeze(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2). x: [*N, H, D]; cos, sin: [*N, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
