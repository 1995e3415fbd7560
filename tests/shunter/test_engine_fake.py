"""The actors end to end, on a fake model whose output depends on a correct KV cache."""

from __future__ import annotations

import random

import anyio
import pytest

from shunter import (
    Engine,
    EngineConfig,
    EngineDeadError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    SamplingParams,
)
from tests.fakes import EOS, VOCAB, expected_continuation, fake_backend

pytestmark = pytest.mark.anyio


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def run_all(engine: Engine, ps: list[list[int]], max_tokens: int) -> list:
    results: list = [None] * len(ps)

    async def one(i: int) -> None:
        results[i] = await engine.complete(ps[i], SamplingParams(max_tokens=max_tokens))

    async with anyio.create_task_group() as tg:
        for i in range(len(ps)):
            tg.start_soon(one, i)
    return results


@pytest.mark.parametrize("num_blocks", [400, 24])
async def test_concurrent_requests_match_the_reference_with_and_without_preemption(num_blocks):
    config = EngineConfig(block_size=4, max_num_seqs=8, max_batched_tokens=32)
    ps = prompts(16)
    async with Engine.start(config, backend=fake_backend(num_blocks, 4)) as engine:
        results = await run_all(engine, ps, max_tokens=20)
        snap = await engine.wait_idle()
    for p, r in zip(ps, results):
        want = expected_continuation(p, 20, {EOS})
        assert list(r.token_ids) == want
        assert r.finish_reason == ("stop" if want[-1] == EOS else "length")
    assert snap.allocator.allocated_blocks == 0
    if num_blocks == 24:
        assert snap.scheduler.preemptions > 0


async def test_leaving_the_loop_or_cancelling_frees_every_block():
    config = EngineConfig(block_size=4, max_num_seqs=4, max_batched_tokens=16)
    async with Engine.start(config, backend=fake_backend(64, 4, step_delay=0.002)) as engine:
        async def leave_early() -> None:
            n = 0
            async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True)):
                n += 1
                if n == 3:
                    break

        async def cancelled() -> None:
            with anyio.move_on_after(0.02):
                async for _ in engine.generate([9] * 10, SamplingParams(max_tokens=240, ignore_eos=True)):
                    pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(leave_early)
            tg.start_soon(cancelled)
            tg.start_soon(engine.complete, [8] * 5, SamplingParams(max_tokens=10))
        with anyio.fail_after(5):
            snap = await engine.wait_idle()
    assert snap.allocator.allocated_blocks == 0


async def test_admission_errors_name_the_problem():
    config = EngineConfig(block_size=4, max_queued_requests=1)
    async with Engine.start(config, backend=fake_backend(8, 4, step_delay=0.01)) as engine:
        with pytest.raises(PromptTooLongError, match="prompt has 40 tokens; the KV pool holds only 32 tokens"):
            await engine.complete([5] * 40)
        with pytest.raises(InvalidRequestError, match="prompt is empty"):
            await engine.complete([])
        with pytest.raises(InvalidRequestError, match=r"prompt_ids holds 500, outside the vocabulary \[0, 97\)"):
            await engine.complete([5, 500])
        with pytest.raises(InvalidRequestError, match="no tokenizer"):
            await engine.complete("text")
        first = engine.generate([5, 6], SamplingParams(max_tokens=30, ignore_eos=True))
        await first.__anext__()
        with pytest.raises(QueueFullError, match="max_queued_requests=1"):
            await engine.complete([5])
        await first.aclose()


async def test_a_failing_step_fails_only_its_requests():
    backend = fake_backend(64, 4)
    original = backend.runner.step

    async def step(msg):
        if any(s.request_id == 2 for s in msg.setups):
            raise RuntimeError("boom")
        return await original(msg)

    backend.runner.step = step
    config = EngineConfig(block_size=4)
    async with Engine.start(config, backend=backend) as engine:
        ok = await engine.complete([5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
        chunks = [c async for c in engine.generate([7], SamplingParams(max_tokens=3))]
        again = await engine.complete([5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
        snap = await engine.wait_idle()
    assert chunks[-1].finish_reason == "error" and "RuntimeError: boom" in chunks[-1].error
    assert ok.token_ids == again.token_ids
    assert snap.allocator.allocated_blocks == 0


async def test_a_crashed_actor_ends_live_requests_with_a_clear_error():
    backend = fake_backend(64, 4)

    async def step(msg):
        raise SystemError("never reached")

    config = EngineConfig(block_size=4)
    async with Engine.start(config, backend=backend) as engine:
        engine_scheduler_inbox = engine._scheduler_send
        await engine_scheduler_inbox.send("not a message")  # the scheduler cannot handle this
        with pytest.raises(EngineDeadError, match="the scheduler actor failed"):
            await engine.complete([5, 6])
