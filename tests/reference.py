"""transformers as the reference implementation: greedy tokens and the logit gaps that decide
whether a divergence is a legitimate near-tie.

`generate()` costs tens of milliseconds per call on a tiny model, and several engine tests ask
for the same prompts (the per-block and groups runs of one workload, the asyncio and trio runs
of one test), so each distinct reference is computed once per session: `reference_model` and
`greedy_reference` are cached by model directory, dtype, prompt and length."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

TIE_GAP = 1e-4
"""Only where the reference's top two logits are this close may the engine pick the second."""


@attrs.frozen
class Reference:
    tokens: tuple[int, ...]
    top2: tuple[tuple[int, int, float], ...]
    """Per step: (best id, second id, best - second logit)."""


@functools.cache
def reference_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    """The transformers model in `model_dir`, loaded once per session (only ever run under
    inference_mode, so tests cannot change it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def greedy_reference(model_dir: Path, prompt: Sequence[int], max_new_tokens: int) -> Reference:
    """transformers' greedy `generate()` of `prompt` (float32), computed once per session."""
    return _greedy_reference(Path(model_dir), tuple(prompt), max_new_tokens)


@functools.cache
def _greedy_reference(model_dir: Path, prompt: tuple[int, ...], max_new_tokens: int) -> Reference:
    return hf_greedy(reference_model(model_dir), prompt, max_new_tokens)


@torch.inference_mode()
def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> Reference:
    out = model.generate(torch.tensor([list(prompt)]), do_sample=False, max_new_tokens=max_new_tokens,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = tuple(out.sequences[0, len(prompt):].tolist())
    top2 = []
    for logits in out.logits:
        vals, ids = torch.topk(logits[0].float(), 2)
        top2.append((int(ids[0]), int(ids[1]), float(vals[0] - vals[1])))
    return Reference(tokens=tokens, top2=tuple(top2))


def assert_matches(engine_tokens: Sequence[int], ref: Reference, label: str) -> None:
    """Token for token, except that at a near-tie (gap <= TIE_GAP) the engine may take the
    reference's second choice; the sequences are not compared past such a point."""
    for k, (got, want) in enumerate(zip(engine_tokens, ref.tokens)):
        if got == want:
            continue
        best, second, gap = ref.top2[k]
        assert gap <= TIE_GAP and got == second, (
            f"{label}: step {k}: engine {got}, reference {want} (top-2 gap {gap:.2e}, second {second})")
        return
    assert len(engine_tokens) == len(ref.tokens), (
        f"{label}: engine produced {len(engine_tokens)} tokens, reference {len(ref.tokens)}")


def mismatches(model_dir: Path, outputs, max_tokens: int | None = None) -> list[str]:
    """Outputs whose tokens differ from the reference other than at a near-tie (as
    `assert_matches` judges), one line each. `outputs`: (prompt, tokens, label) with
    `max_tokens`, or (prompt, tokens, label, max_tokens)."""
    bad = []
    for prompt, tokens, label, *own in outputs:
        ref = greedy_reference(model_dir, prompt, own[0] if own else max_tokens)
        for k, (got, want) in enumerate(zip(tokens, ref.tokens)):
            if got != want:
                best, second, gap = ref.top2[k]
                if not (gap <= TIE_GAP and got == second):
                    bad.append(f"{label}: step {k}: engine {got}, reference {want}")
                break
        else:
            if len(tokens) != len(ref.tokens):
                bad.append(f"{label}: {len(tokens)} tokens, reference {len(ref.tokens)}")
    return bad
