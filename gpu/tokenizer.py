"""Tokenizer over a `tokenizer.json` (the `tokenizers` library), incremental detokenization, and
training the byte-level BPE that generated models ship with."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from engine.errors import ModelLoadError

_EOS_NAMES = ("<|eos|>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>")
_REPLACEMENT = "\ufffd"


def _json_key(path: Path, key: str) -> object:
    """`key` of a JSON object file; None if the file or the key is absent."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON object: {e}") from e


def _eos_ids(path: Path) -> tuple[int, ...] | None:
    value = _json_key(path, "eos_token_id")
    if value is None:
        return None
    return (value,) if isinstance(value, int) else tuple(value)  # type: ignore[arg-type]


class Tokenizer:
    """Text <-> token ids for one model."""

    def __init__(self, tok: tokenizers.Tokenizer, *, eos_token_ids: Sequence[int] = (),
                 bos_token_id: int | None = None) -> None:
        self.tok = tok
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        """Ids that end generation."""
        self.bos_token_id = bos_token_id

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json; eos ids come from generation_config.json, else config.json,
        else a token with a conventional end-of-sequence name."""
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"model directory {d} has no tokenizer.json")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise ModelLoadError(f"{path}: cannot load tokenizer: {e}") from e
        eos = _eos_ids(d / "generation_config.json") or _eos_ids(d / "config.json")
        if eos is None:
            eos = tuple(i for n in _EOS_NAMES if (i := tok.token_to_id(n)) is not None)
        bos = _json_key(d / "config.json", "bos_token_id")
        return cls(tok, eos_token_ids=eos, bos_token_id=bos)  # type: ignore[arg-type]

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids; BOS is added only when the tokenizer's post-processor adds it."""
        return self.tok.encode(text).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas.

    Byte-level BPE can split one character's UTF-8 bytes across tokens; while the decoded tail
    ends in U+FFFD (an incomplete character) nothing is emitted. `read` only ever advances to a
    point where the text decoded cleanly, i.e. a character boundary, so decoding from `prefix`
    (a few tokens of context for decoders that strip a leading space) and cutting off the text
    of ids[prefix:read] leaves exactly the new characters.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids)
        self._read = len(self._ids)
        self._prefix = max(0, self._read - 4)
        self.text = ""
        """Everything emitted so far."""

    def add(self, new_ids: Iterable[int]) -> str:
        """Append generated ids; returns the text they complete (maybe empty)."""
        self._ids.extend(new_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """At the end of generation: emit whatever is held back, even an incomplete tail."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        after = self._tokenizer.decode(self._ids[self._prefix:])
        if after.endswith(_REPLACEMENT) and not final:
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta


def train_byte_level_bpe(
    texts: Iterable[str], vocab_size: int,
    special_tokens: Sequence[str] = ("<|bos|>", "<|eos|>"),
) -> tokenizers.Tokenizer:
    """A byte-level BPE with exactly `vocab_size` ids: the special tokens (ids 0, 1, ...), the
    256 byte symbols, then merges (padded with `<|extra_N|>` tokens if the text runs out of
    merges). Training is deterministic for the same texts."""
    floor = len(special_tokens) + 256 + 1
    if vocab_size < floor:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE with "
                         f"{len(special_tokens)} special tokens needs at least {floor}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|extra_{i}|>" for i in range(missing)])
    return tok
