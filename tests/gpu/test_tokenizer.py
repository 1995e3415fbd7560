"""Tokenizer round trips, BOS handling, eos ids, BPE training, and the incremental detokenizer
(never half a character; its deltas add up to the full decode)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu.make_model import corpus_texts
from gpu.tokenizer import IncrementalDetokenizer, Tokenizer, train_byte_level_bpe
from shunter import ModelLoadError

TEXTS = [
    "def main() -> None:\n    print('hello, world')\n",
    "Grüße, naïve café — 日本語のテキスト, 한국어, русский, emoji 🙂🚀 and ∑∞≠.",
    "",
    " leading and trailing spaces  ",
]


@pytest.fixture(scope="module")
def llama_tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def qwen2_tok(tiny_qwen2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_qwen2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(llama_tok: Tokenizer, qwen2_tok: Tokenizer, text: str) -> None:
    for tok in (llama_tok, qwen2_tok):
        assert tok.decode(tok.encode(text)) == text


def test_bos_only_where_the_post_processor_adds_it(llama_tok: Tokenizer,
                                                   qwen2_tok: Tokenizer) -> None:
    assert llama_tok.encode("hi")[0] == 0 and llama_tok.bos_token_id == 0
    assert 0 not in qwen2_tok.encode("hi")
    assert llama_tok.encode("hi")[1:] == qwen2_tok.encode("hi")


def test_vocab_and_eos(llama_tok: Tokenizer) -> None:
    assert llama_tok.vocab_size == 320
    assert llama_tok.eos_token_ids == (1,)
    assert llama_tok.decode([1, *llama_tok.encode("x")[1:]]) == "x"  # specials are skipped


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_dir(tmp_path)
    assert str(info.value) == f"model directory {tmp_path} has no tokenizer.json"


def test_malformed_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer.json: cannot load tokenizer: "):
        Tokenizer.from_dir(tmp_path)


def test_training_is_deterministic_and_exact() -> None:
    texts = corpus_texts()
    a, b = train_byte_level_bpe(texts, 500), train_byte_level_bpe(texts, 500)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 500
    assert (a.token_to_id("<|bos|>"), a.token_to_id("<|eos|>")) == (0, 1)
    # a corpus with too few merges is padded with extra special tokens
    tiny = train_byte_level_bpe(["ab ab ab"], 300)
    assert tiny.get_vocab_size() == 300 and tiny.token_to_id("<|extra_0|>") is not None
    with pytest.raises(ValueError, match="vocab_size=258 is too small: .* needs at least 259"):
        train_byte_level_bpe(texts, 258)


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt or [])
    deltas = [detok.add([i]) for i in ids]
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    return deltas


def test_incremental_never_emits_half_a_character(qwen2_tok: Tokenizer) -> None:
    text = TEXTS[1]
    ids = qwen2_tok.encode(text)
    # the test is only meaningful if some token holds part of a character
    assert any("\ufffd" in qwen2_tok.decode([i]) for i in ids)
    deltas = _stream(qwen2_tok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text


def test_incremental_after_a_prompt(llama_tok: Tokenizer) -> None:
    prompt = llama_tok.encode("Grüße ")
    ids = llama_tok.encode("日本語 🙂 done")[1:]  # without BOS
    deltas = _stream(llama_tok, ids, prompt)
    assert "".join(deltas) == "日本語 🙂 done"
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 319), max_size=30), chunk=st.integers(1, 4))
def test_incremental_deltas_add_up_to_decode(qwen2_tok: Tokenizer, ids: list[int],
                                             chunk: int) -> None:
    # arbitrary ids are often invalid UTF-8: the deltas must still add up to decode(ids)
    detok = IncrementalDetokenizer(qwen2_tok)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    assert not any(d.endswith("\ufffd") for d in deltas)
    assert "".join(deltas) + detok.finish() == qwen2_tok.decode(ids)


def test_eos_sources(tmp_path: Path, tiny_llama_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
    # no config at all: the token named <|eos|>
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (1,)
    (tmp_path / "config.json").write_text('{"eos_token_id": 5, "bos_token_id": 0}')
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (5,)
    # generation_config.json wins, as it does for transformers' generate
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, 7]}')
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (1, 7)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="generation_config.json: cannot read JSON object"):
        Tokenizer.from_dir(tmp_path)
