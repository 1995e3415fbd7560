"""Token sampling for a batch: greedy rows in one argmax, the others one by one with the
request's own generator (so a seeded request samples the same tokens whatever its batch mates)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.params import SamplingParams


def make_generator(params: SamplingParams, fallback_seed: int, device: torch.device) -> torch.Generator | None:
    """A request's own generator; None for greedy requests, which never draw."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return gen


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] -> [V] with the excluded tokens at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token once the tokens before it already reach top_p (the first always stays)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """logits: [S, V] float32, one row per sequence that samples -> one token id per row."""
    out = torch.argmax(logits, dim=-1)  # [S]
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        scaled = _filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(scaled, dim=-1)
        out[row] = torch.multinomial(probs, 1, generator=gen)[0]
    return out.tolist()
