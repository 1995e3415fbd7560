"""Triton kernels. On a machine without CUDA they run only under TRITON_INTERPRET=1, which must be
set before triton is first imported (tests/conftest.py does)."""

from __future__ import annotations

from gpu.kernels.decode_attention import DecodeTiles, decode_attention_triton
from gpu.kernels.prefill_attention import PrefillTiles, prefill_attention_triton

__all__ = ["DecodeTiles", "PrefillTiles", "decode_attention_triton", "prefill_attention_triton"]
