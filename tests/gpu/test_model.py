"""CausalLM against transformers (the reference implementation) on tiny random models: the dense
forward, the paged forward driven chunk by chunk through shuffled block tables, bf16, and greedy
generation token for token."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import attrs
import pytest
import torch

from gpu.config import ModelConfig, RopeScaling
from gpu.metadata import build_step_inputs
from gpu.model import CausalLM
from tests.reference import reference_model

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
# (seq, start, end) chunks per step, prefills first; later steps mix prefills and decodes
SEQ_LENS = {"a": 26, "b": 13, "c": 28, "d": 6, "e": 3}
SCHEDULE = [
    [("a", 0, 6), ("c", 0, 11)],
    [("a", 6, 15), ("b", 0, 9), ("c", 11, 20)],
    [("a", 15, 23), ("c", 20, 25), ("b", 9, 10)],
    [("e", 0, 1), ("d", 0, 6), ("a", 23, 24), ("b", 10, 11), ("c", 25, 26)],
    [("a", 24, 25), ("b", 11, 12), ("c", 26, 27), ("e", 1, 2)],
    [("a", 25, 26), ("b", 12, 13), ("c", 27, 28), ("e", 2, 3)],
]


def _variant(tmp: Path, base: Path, seed: int, **changes: object) -> Path:
    """A model like `base` with config changes, random weights, base's tokenizer."""
    config = attrs.evolve(ModelConfig.from_dir(base), **changes)
    out = CausalLM.init_random(config, seed=seed).save_pretrained(tmp)
    shutil.copy(base / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def model_dirs(tiny_llama_dir: Path, tiny_qwen2_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    def make(name: str, base: Path, seed: int, **changes: object) -> Path:
        return _variant(tmp_path_factory.mktemp(name), base, seed, **changes)

    return {
        "llama": tiny_llama_dir,
        "qwen2": tiny_qwen2_dir,
        "llama-tied-mha-bias": make("l1", tiny_llama_dir, 2, tie_word_embeddings=True,
                                    num_kv_heads=4, num_layers=3, attention_bias=True),
        "qwen2-tied-mqa": make("q1", tiny_qwen2_dir, 3, tie_word_embeddings=True,
                               num_kv_heads=1),
        "llama-rope-llama3": make("l2", tiny_llama_dir, 4, rope_theta=5000.0, rope_scaling=(
            RopeScaling(kind="llama3", factor=4.0, original_max_position_embeddings=64))),
        "llama-rope-linear": make("l3", tiny_llama_dir, 5, rope_scaling=RopeScaling(
            kind="linear", factor=2.0)),
    }


ALL = ["llama", "qwen2", "llama-tied-mha-bias", "qwen2-tied-mqa", "llama-rope-llama3",
       "llama-rope-linear"]


def _sequences(vocab: int, seed: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randint(2, vocab, (n,), generator=gen).tolist()
            for name, n in SEQ_LENS.items()}


@torch.inference_mode()
def _hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()  # [S, V]


def _shuffled_tables(model: CausalLM, lens: dict[str, int], seed: int) -> dict[str, list[int]]:
    """Each sequence gets blocks scattered over the pool, in no particular order."""
    free = list(model.arena.kv_block_ids)
    random.Random(seed).shuffle(free)
    tables = {}
    for name, n in lens.items():
        count = -(-n // BLOCK_SIZE)
        tables[name], free = free[:count], free[count:]
    return tables


@torch.inference_mode()
def _run_schedule(model: CausalLM, seqs: dict[str, list[int]],
                  tables: dict[str, list[int]]) -> list[tuple[str, int, int, torch.Tensor]]:
    """Feed SCHEDULE to the paged forward; logits (on the CPU) for every token of every chunk."""
    out = []
    device = model.arena.device
    for chunks in SCHEDULE:
        inputs = build_step_inputs([(seqs[n][s:e], s, tables[n]) for n, s, e in chunks],
                                   BLOCK_SIZE, device)
        every_row = torch.arange(inputs.input_ids.shape[0], device=device)
        logits = model(inputs.input_ids, inputs.positions, inputs.meta, every_row).cpu()
        row = 0
        for n, s, e in chunks:
            out.append((n, s, e, logits[row:row + e - s]))
            row += e - s
    return out


@pytest.mark.parametrize("variant", ALL)
def test_dense_forward_matches_transformers(model_dirs: dict[str, Path], variant: str) -> None:
    d = model_dirs[variant]
    model = CausalLM.from_pretrained(d, num_kv_blocks=4, block_size=BLOCK_SIZE)
    tokens = torch.randint(2, model.config.vocab_size, (3, 17), generator=torch.Generator()
                           .manual_seed(0))
    with torch.inference_mode():
        ours = model.forward_dense(tokens)
        ref = reference_model(d)(tokens).logits.float()
    assert ours.shape == (3, 17, model.config.vocab_size) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ALL)
def test_paged_forward_matches_transformers(model_dirs: dict[str, Path], variant: str) -> None:
    d = model_dirs[variant]
    model = CausalLM.from_pretrained(d, num_kv_blocks=40, block_size=BLOCK_SIZE)
    seqs = _sequences(model.config.vocab_size, seed=1)
    hf = reference_model(d)
    ref = {n: _hf_logits(hf, t) for n, t in seqs.items()}
    results = _run_schedule(model, seqs, _shuffled_tables(model, SEQ_LENS, seed=2))
    assert {(n, e) for n, _, e, _ in results} >= {(n, ln) for n, ln in SEQ_LENS.items()}
    for n, s, e, logits in results:
        torch.testing.assert_close(logits, ref[n][s:e], atol=1e-4, rtol=1e-4,
                                   msg=lambda m, n=n, s=s, e=e: f"seq {n} [{s}:{e}]: {m}")


def test_triton_backend_matches_transformers(model_dirs: dict[str, Path]) -> None:
    # on a CPU the kernels run under the Triton interpreter (see tests/conftest.py)
    d = model_dirs["qwen2-tied-mqa"]
    model = CausalLM.from_pretrained(d, num_kv_blocks=40, block_size=BLOCK_SIZE,
                                     attention_backend="triton")
    seqs = _sequences(model.config.vocab_size, seed=5)
    hf = reference_model(d)
    ref = {n: _hf_logits(hf, t) for n, t in seqs.items()}
    for n, s, e, logits in _run_schedule(model, seqs, _shuffled_tables(model, SEQ_LENS, 6)):
        torch.testing.assert_close(logits, ref[n][s:e], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_checkpoint_dtype_matches_transformers(model_dirs: dict[str, Path],
                                                    backend: str) -> None:
    d = model_dirs["qwen2"]
    model = CausalLM.from_pretrained(d, device="cuda", num_kv_blocks=40, block_size=BLOCK_SIZE,
                                     attention_backend=backend)  # type: ignore[arg-type]
    assert model.arena.dtype == torch.float32  # dtype None: the checkpoint's on CUDA
    seqs = _sequences(model.config.vocab_size, seed=7)
    hf = reference_model(d)
    ref = {n: _hf_logits(hf, t) for n, t in seqs.items()}
    for n, s, e, logits in _run_schedule(model, seqs, _shuffled_tables(model, SEQ_LENS, 8)):
        torch.testing.assert_close(logits, ref[n][s:e], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_bf16_matches_transformers(model_dirs: dict[str, Path], variant: str) -> None:
    d = model_dirs[variant]
    model = CausalLM.from_pretrained(d, dtype=torch.bfloat16, num_kv_blocks=40,
                                     block_size=BLOCK_SIZE)
    assert model.arena.dtype == torch.bfloat16
    seqs = _sequences(model.config.vocab_size, seed=3)
    hf = reference_model(d, torch.bfloat16)
    ref = {n: _hf_logits(hf, t) for n, t in seqs.items()}
    with torch.inference_mode():
        dense = model.forward_dense(torch.tensor([seqs["a"]]))[0]
    # the dense path runs the same bf16 ops as transformers; the paged one differs by a few
    # bf16 ulps (logits here are ~0.5, where one ulp is 2e-3)
    torch.testing.assert_close(dense, ref["a"], atol=2e-3, rtol=0)
    for n, s, e, logits in _run_schedule(model, seqs, _shuffled_tables(model, SEQ_LENS, 4)):
        torch.testing.assert_close(logits, ref[n][s:e], atol=1e-2, rtol=0)


@torch.inference_mode()
def _greedy(model: CausalLM, prompt: list[int], max_new: int, eos: int) -> list[int]:
    """Prefill the prompt in one chunk, then decode one token per step until eos."""
    table = list(model.arena.kv_block_ids)[::-1][:-(-(len(prompt) + max_new) // BLOCK_SIZE)]
    tokens, out, start = list(prompt), [], 0
    while len(out) < max_new and (not out or out[-1] != eos):
        inputs = build_step_inputs([(tokens[start:], start, table)], BLOCK_SIZE, "cpu")
        logits = model(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)
        start = len(tokens)
        tokens.append(int(logits[0].argmax()))
        out.append(tokens[-1])
    return out


@pytest.mark.parametrize("variant", ["llama", "qwen2-tied-mqa"])
def test_greedy_matches_transformers_generate(model_dirs: dict[str, Path], variant: str) -> None:
    d = model_dirs[variant]
    model = CausalLM.from_pretrained(d, num_kv_blocks=32, block_size=BLOCK_SIZE)
    hf = reference_model(d)
    for prompt in ([5, 17, 99, 200, 3], [42], list(range(2, 30))):
        ours = _greedy(model, prompt, max_new=12, eos=1)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                              eos_token_id=1, pad_token_id=1)[0, len(prompt):].tolist()
        assert ours == ref, f"prompt {prompt[:5]}...: ours {ours}, transformers {ref}"


def test_logits_only_at_requested_rows(model_dirs: dict[str, Path]) -> None:
    model = CausalLM.from_pretrained(model_dirs["llama"], num_kv_blocks=8, block_size=BLOCK_SIZE)
    ids = list(range(2, 12))
    table = list(model.arena.kv_block_ids)[:3]
    with torch.inference_mode():
        inputs = build_step_inputs([(ids, 0, table)], BLOCK_SIZE, "cpu")
        every = model(inputs.input_ids, inputs.positions, inputs.meta, torch.arange(10))
        some = model(inputs.input_ids, inputs.positions, inputs.meta, torch.tensor([9, 2]))
    assert some.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(some, every[[9, 2]])


def test_init_random_trains_and_round_trips(tmp_path: Path, tiny_llama_dir: Path) -> None:
    config = ModelConfig.from_dir(tiny_llama_dir)
    model = CausalLM.init_random(config, seed=7)
    tokens = torch.randint(2, config.vocab_size, (2, 9), generator=torch.Generator()
                           .manual_seed(0))
    loss = torch.nn.functional.cross_entropy(
        model.forward_dense(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    with pytest.raises(RuntimeError, match="from_pretrained"):
        model(tokens[0], tokens[0], None, tokens[0])  # type: ignore[arg-type]
    out = _variant(tmp_path, tiny_llama_dir, 7)
    loaded = CausalLM.from_pretrained(out, num_kv_blocks=2, block_size=BLOCK_SIZE)
    with torch.inference_mode():
        torch.testing.assert_close(loaded.forward_dense(tokens), model.forward_dense(tokens),
                                   atol=0, rtol=0)
