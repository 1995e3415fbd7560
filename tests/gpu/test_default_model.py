"""The shipped model in gpu/default_model/: it loads with Shunter and with transformers, both give
the same logits, and it has learned Python (low loss on code it never saw, far lower than on the
same tokens shuffled; a method's `def ` continued through the paged forward looks like a
definition)."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from engine.config import default_model_dir
from gpu.config import ModelConfig
from gpu.metadata import build_step_inputs
from gpu.model import CausalLM
from gpu.tokenizer import Tokenizer

MODEL_DIR = default_model_dir()
BLOCK_SIZE = 16
# Written for this test, not taken from the standard library: ordinary Python the model has not
# memorised, the same in every Python version, and like the training text without docstrings.
SNIPPET = '''\
import os


class Inventory:

    def __init__(self, items=None):
        self.items = dict(items or {})

    def add(self, name, count=1):
        if count < 0:
            raise ValueError("count must not be negative")
        self.items[name] = self.items.get(name, 0) + count
        return self.items[name]

    def save(self, path):
        with open(os.path.join(path, "inventory.txt"), "w") as f:
            for name, count in sorted(self.items.items()):
                f.write(f"{name} {count}\\n")
'''
MAX_LOSS = 3.0
"""Mean next-token loss on SNIPPET in nats; an untrained model scores about ln(vocab) = 8.3."""
MIN_SHUFFLE_GAP = 2.0
"""Shuffling SNIPPET's tokens must cost at least this much loss: a model that knew only token
frequencies (no context) would score the same on both."""


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return CausalLM.from_pretrained(MODEL_DIR, num_kv_blocks=8, block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    return model.eval()


def _loss(model: CausalLM, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = model.forward_dense(torch.tensor([ids]))[0]  # [S, V]
    return F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()


def _paged_greedy(model: CausalLM, prompt: list[int], max_tokens: int,
                  eos: tuple[int, ...]) -> list[int]:
    """Greedy decoding through the serving path: one prefill, then one-token decode steps."""
    table = list(model.arena.kv_block_ids)
    ids, cached = list(prompt), 0
    for _ in range(max_tokens):
        inputs = build_step_inputs([(ids[cached:], cached, table)], BLOCK_SIZE, "cpu")
        logits = model(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)
        cached, token = len(ids), int(logits[0].argmax())
        if token in eos:
            break
        ids.append(token)
    return ids[len(prompt):]


def test_directory_is_a_small_llama(tokenizer: Tokenizer) -> None:
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "generation_config.json"} <= names
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir()) < 8_000_000
    config = ModelConfig.from_dir(MODEL_DIR)
    assert (config.arch, config.tie_word_embeddings) == ("llama", True)
    assert config.num_kv_heads < config.num_heads
    assert tokenizer.vocab_size == config.vocab_size
    assert tokenizer.eos_token_ids == (1,) and tokenizer.bos_token_id == 0
    assert tokenizer.encode("def f():")[0] == 0  # <|bos|> first, as in training
    log = json.loads((MODEL_DIR / "training_log.json").read_text())
    assert log["train_config"]["vocab"] == config.vocab_size


def test_dense_forward_matches_transformers(model: CausalLM, tokenizer: Tokenizer,
                                            hf_model: torch.nn.Module) -> None:
    ids = torch.tensor([tokenizer.encode(SNIPPET)[:64]])
    with torch.inference_mode():
        ours = model.forward_dense(ids)
        ref = hf_model(ids).logits.float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_low_loss_on_unseen_python(model: CausalLM, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(SNIPPET)
    body = ids[1:]
    random.Random(0).shuffle(body)
    loss, shuffled = _loss(model, ids), _loss(model, ids[:1] + body)
    assert loss < MAX_LOSS
    assert shuffled - loss > MIN_SHUFFLE_GAP


def test_paged_greedy_method_is_a_definition(model: CausalLM, tokenizer: Tokenizer,
                                             hf_model: torch.nn.Module) -> None:
    prompt = tokenizer.encode("class Foo:\n    def ")
    ours = _paged_greedy(model, prompt, 32, tokenizer.eos_token_ids)
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=len(ours),
                                do_sample=False)[0, len(prompt):].tolist()
    assert ours == ref
    out = tokenizer.decode(ours)
    head, _, rest = out.partition("\n")
    # the signature line: a name, arguments, a colon; then an indented body
    assert head[:1].isidentifier() and "(" in head and head.rstrip().endswith(":"), out
    assert rest.startswith("    "), out
