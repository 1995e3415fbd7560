"""Greedy output of the engine equals transformers' generate(), token for token, for 16
concurrent prompts of mixed lengths, with an ample KV pool and with one that forces preemption."""

from __future__ import annotations

import random

import anyio
import pytest

from shunter import Engine, EngineConfig, SamplingParams
from tests.reference import assert_matches, greedy_reference

pytestmark = pytest.mark.anyio

MAX_TOKENS = 24


def mixed_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.choice([1, 3, 9, 17, 33, 60]))] for _ in range(n)]


@pytest.fixture
def model_dirs(tiny_llama_dir, tiny_qwen2_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("num_blocks", [256, 12])
async def test_greedy_matches_transformers(model_dirs, arch, num_blocks):
    model_dir = model_dirs[arch]
    prompts = mixed_prompts(16, 320, seed={"llama": 1, "qwen2": 2}[arch])
    config = EngineConfig(model=model_dir, num_blocks=num_blocks, max_batched_tokens=64,
                          max_num_seqs=16)
    results: list = [None] * len(prompts)
    async with Engine.start(config) as engine:
        async def one(i: int) -> None:
            results[i] = await engine.complete(prompts[i], SamplingParams(max_tokens=MAX_TOKENS))

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        snap = await engine.wait_idle()
    for i, (r, prompt) in enumerate(zip(results, prompts)):
        ref = greedy_reference(model_dir, prompt, MAX_TOKENS)
        assert_matches(r.token_ids, ref, f"{arch} prompt {i} (len {len(prompt)})")
    assert snap.allocator.allocated_blocks == 0
    if num_blocks == 12:
        assert snap.scheduler.preemptions > 0, "the small pool was meant to force preemption"
