"""Automatic prefix caching end to end on the torch backend (issue 13, item 6).

A KV pool of 14 blocks of 8 tokens serves requests sharing a 20-token system prompt (at once,
then again with other questions), three 3-turn conversations, and pairs of prompts made of the
same two blocks in the other order. Blocks are cached, shared between live requests, evicted
and reused, requests are preempted (by recompute, or by swap with priorities redrawn every
iteration): greedy outputs must equal transformers' token for token, under asyncio and
trio, and no block may be left allocated once idle. A planted bug, block keys that ignore the
parent block, must make the outputs go wrong (the swapped pair hits the other's blocks).
"""

from __future__ import annotations

import random

import anyio
import pytest

from engine.memory import prefix_cache
from policies import policy_dir
from policy_lang import compile_policy
from shunter import Engine, EngineConfig, SamplingParams, SchedulingParams
from tests.conftest import slow_scale
from tests.shunter.test_fastswitch import mismatches

pytestmark = pytest.mark.anyio

MAX_TOKENS = 12  # as test_fastswitch.mismatches compares
VOCAB = 320
SHARERS = slow_scale(16, 6)
POLICIES = {
    "recompute": "policy apc { memory { prefix_cache on } }\n",
    "swap": 'policy apc_swap extends "vllm_prefix_random.policy" {\n'
            "  every 1 iterations: rerank random(seed = 5)\n}\n",
}


async def serve(model_dir, policy_name: str, *, seed: int = 0):
    """Run the workload; returns ([(prompt, tokens, label)], snapshot, most blocks two live
    requests' tables had in common at one inspection)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(2, VOCAB) for _ in range(n)]

    system = tokens(20)
    questions = [system + tokens(rng.choice([3, 7, 12])) for _ in range(2 * SHARERS)]
    openers = [tokens(rng.choice([10, 17])) for _ in range(3)]
    follow_ups = [[tokens(rng.choice([2, 6])) for _ in range(2)] for _ in range(3)]
    p, q = tokens(8), tokens(8)
    pairs = [(p + q + tokens(3), q + p + tokens(5)), (q + q + tokens(2), p + q + tokens(4))]
    policy = compile_policy(POLICIES[policy_name], base_dir=policy_dir())
    config = EngineConfig(model=model_dir, num_blocks=14, block_size=8, max_batched_tokens=48,
                          max_num_seqs=8, cpu_swap_blocks=80)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    served: list[tuple[list[int], list[int], str]] = []
    most_shared = 0
    async with Engine.start(config, policy=policy) as engine:
        async def ask(prompt: list[int], label: str, conversation: str | None = None) -> list[int]:
            r = await engine.complete(prompt, params, scheduling=SchedulingParams(
                conversation_id=conversation))
            served.append((list(prompt), r.token_ids, label))
            return r.token_ids

        async def conversation(c: int) -> None:
            history = list(openers[c])
            for turn in range(3):
                history += follow_ups[c][turn - 1] if turn else []
                out = await ask(history, f"conversation {c} turn {turn + 1}", f"c{c}")
                # the reference's generate() takes token 0 for padding and masks it out
                history += [t for t in out if t != 0]

        async def watch_sharing(stop: anyio.Event) -> None:
            nonlocal most_shared
            while not stop.is_set():
                tables = list((await engine.inspect()).allocator.tables.values())
                for i, a in enumerate(tables):
                    for b in tables[i + 1:]:
                        most_shared = max(most_shared, len(set(a) & set(b)))
                await anyio.sleep(0.002)

        stop = anyio.Event()
        async with anyio.create_task_group() as outer:
            outer.start_soon(watch_sharing, stop)
            async with anyio.create_task_group() as tg:
                for c in range(3):
                    tg.start_soon(conversation, c)
                for i in range(SHARERS):
                    tg.start_soon(ask, questions[i], f"question {i}")
            async with anyio.create_task_group() as tg:  # the system prompt's blocks again
                for i in range(SHARERS, 2 * SHARERS):
                    tg.start_soon(ask, questions[i], f"question {i}")
            for k, (first, second) in enumerate(pairs):  # same blocks, other order
                await ask(first, f"pair {k} first")
                await ask(second, f"pair {k} second")
            stop.set()
        snap = await engine.wait_idle()
    return served, snap, most_shared


@pytest.mark.parametrize(("anyio_backend", "policy_name"),
                         [("asyncio", "recompute"), ("trio", "swap")])
async def test_outputs_match_transformers_with_blocks_cached_shared_and_evicted(
        tiny_llama_dir, policy_name):
    served, snap, most_shared = await serve(tiny_llama_dir, policy_name)
    assert len(served) == 2 * SHARERS + 9 + 4
    assert mismatches(tiny_llama_dir, served) == []
    counts = snap.scheduler.prefix_cache
    # the cache was really used: hits (the system prompt, earlier turns), evictions (the pool
    # is small), preemptions, and blocks shared by two live requests at once
    assert counts.hit_blocks >= SHARERS, counts
    assert counts.evicted_blocks > 0, counts
    assert snap.scheduler.preemptions >= (4 if policy_name == "recompute" else 20)
    assert most_shared >= 2, "no two live requests ever shared a cached block"
    # nothing leaked: no block is allocated once idle, the cached ones are idle and free
    assert snap.allocator.allocated_blocks == 0
    assert snap.allocator.cached_blocks > 0
    assert snap.scheduler.free_blocks == snap.allocator.total_blocks


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_key_that_ignores_the_parent_block_corrupts_outputs(tiny_llama_dir, monkeypatch):
    """The planted bug: a block is known by its own tokens only, so a block holding q after p
    is handed to a request whose q comes first. If this passes, the test above can tell."""
    real = prefix_cache.block_key
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, tokens: real(b"", tokens))
    served, _, _ = await serve(tiny_llama_dir, "recompute")
    bad = mismatches(tiny_llama_dir, served)
    assert any(label.startswith("pair") for label in bad), bad
