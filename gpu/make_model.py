"""Writing a small random model directory that both Shunter and transformers load: config.json,
model.safetensors, tokenizer.json (a byte-level BPE trained on Python's own standard library
sources, so nothing is downloaded) and generation_config.json. Same seed, same bytes."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
from pathlib import Path

import tokenizers
from tokenizers import processors

from engine.errors import ConfigError
from gpu.config import DTYPES, ModelConfig
from gpu.model import CausalLM
from gpu.tokenizer import train_byte_level_bpe

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>")
BOS_ID, EOS_ID = 0, 1
_CORPUS_MODULES = ("textwrap", "string", "json.decoder", "shlex", "fractions", "heapq",
                   "bisect", "calendar")
_CORPUS_EXTRA = (
    "Grüße aus Köln! Ça va très bien. Smörgåsbord, naïve café, Ærøskøbing.\n"
    "日本語のテキストと中文文本。한국어 문장입니다. Ελληνικά και русский текст.\n"
    "Emoji: 🙂🚀🎉 — “quotes” ‘single’ … ≤ ≥ ≠ ∑ ∞ → ←\n"
)
_CORPUS_CHARS = 120_000
"""Enough text for a few thousand merges; more only slows training down."""


def corpus_texts() -> list[str]:
    """Offline training text: a few standard library sources plus some multibyte text."""
    texts = []
    for name in _CORPUS_MODULES:
        path = inspect.getsourcefile(importlib.import_module(name))
        if path is not None:
            texts.append(Path(path).read_text(encoding="utf-8"))
    text = "\n".join(texts)[:_CORPUS_CHARS]
    return [text[i:i + 4096] for i in range(0, len(text), 4096)] + [_CORPUS_EXTRA] * 20


def add_bos_on_encode(tok: tokenizers.Tokenizer) -> None:
    """Make `encode` prefix every sequence with <|bos|>, as Llama tokenizers do."""
    bos = SPECIAL_TOKENS[BOS_ID]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, BOS_ID)]),
    ])


def write_generation_config(out_dir: Path) -> None:
    """generation_config.json: greedy by default, ending at <|eos|>."""
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab: int, add_bos: bool) -> str:
    tok = train_byte_level_bpe(corpus_texts(), vocab, special_tokens=SPECIAL_TOKENS)
    if add_bos:
        add_bos_on_encode(tok)
    return tok.to_str(pretty=True)


def _default_intermediate(hidden: int) -> int:
    """About 8/3 * hidden (Llama's SwiGLU ratio), rounded up to a multiple of 32."""
    return -(-8 * hidden // (3 * 32)) * 32


def random_model_config(*, arch: str, layers: int, hidden: int, heads: int, kv_heads: int,
                        vocab: int, intermediate: int | None = None, dtype: str = "float32",
                        tie_embeddings: bool | None = None,
                        max_position_embeddings: int = 2048) -> ModelConfig:
    # ConfigErrors name the `shunter make-model` options the arguments come from
    if arch not in ("llama", "qwen2"):
        raise ConfigError(f"--arch {arch}: not llama or qwen2")
    if vocab < 259:
        raise ConfigError(f"--vocab {vocab} is too small: the byte-level tokenizer needs 256 byte "
                          "ids, 2 special tokens and at least one merge (--vocab 259 or more)")
    if hidden % heads:
        raise ConfigError(f"--hidden {hidden} is not divisible by --heads {heads}")
    if heads % kv_heads:
        raise ConfigError(f"--heads {heads} is not divisible by --kv-heads {kv_heads}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: not one of {', '.join(DTYPES)}")
    return ModelConfig(
        arch=arch, vocab_size=vocab, hidden_size=hidden,  # type: ignore[arg-type]
        intermediate_size=intermediate or _default_intermediate(hidden),
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=bool(tie_embeddings), attention_bias=arch == "qwen2",
        bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,), torch_dtype=dtype,
    )


def write_random_model(
    out_dir: str | Path, *, arch: str, layers: int, hidden: int, heads: int, kv_heads: int,
    vocab: int, seed: int, intermediate: int | None = None, dtype: str = "float32",
    tie_embeddings: bool | None = None, max_position_embeddings: int = 2048,
) -> Path:
    """Write a random model directory; returns it. tie_embeddings None means untied (the
    transformers default for both families). Qwen2 gets random q/k/v biases."""
    config = random_model_config(
        arch=arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
        intermediate=intermediate, dtype=dtype, tie_embeddings=tie_embeddings,
        max_position_embeddings=max_position_embeddings)
    out = Path(out_dir)
    CausalLM.init_random(config, seed=seed, dtype=DTYPES[dtype]).save_pretrained(out)
    (out / "tokenizer.json").write_text(_tokenizer_json(vocab, arch == "llama"))
    write_generation_config(out)
    return out
