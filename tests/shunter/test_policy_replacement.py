"""The engine runs whatever policy is loaded: from the config, replaced while it serves (losing
no request), refused when broken or unsupported (the old one keeps running), and the overload
triggers it reports."""

from __future__ import annotations

import contextlib
import logging
import random

import anyio
import attrs
import pytest
import structlog

from engine.policy import FcfsPolicy
from policies import policy_path
from policy_lang import CompiledPolicy, load_policy_file
from shunter import (
    Engine,
    EngineConfig,
    PolicyCheckError,
    PolicySyntaxError,
    RequestFailedError,
    SamplingParams,
    SchedulingParams,
)
from tests.fakes import EOS, VOCAB, expected_continuation, fake_backend

pytestmark = pytest.mark.anyio

CONFIG = EngineConfig(block_size=4, max_num_seqs=8, max_batched_tokens=32)


@contextlib.contextmanager
def captured_logs():
    """Info-level structlog events, whatever the CLI tests configured before."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**saved)


async def wait_iterations(engine: Engine, n: int) -> None:
    start = (await engine.inspect()).scheduler.iteration
    while (await engine.inspect()).scheduler.iteration < start + n:
        await anyio.sleep(0.001)


async def test_replacing_the_policy_while_100_requests_stream_loses_none():
    rng = random.Random(3)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(2, 24))] for _ in range(100)]
    results: list = [None] * 100
    replacements = [policy_path(n).read_text() for n in
                    ("priority", "fcfs", "vtc", "round_robin_rtbe", "kunserve_drop", "bros_no_bicache")]
    config = EngineConfig(block_size=4, max_num_seqs=8, max_batched_tokens=32,
                          policy=policy_path("bros_no_bicache"))
    with captured_logs() as logs:
        async with Engine.start(config, backend=fake_backend(40, 4, step_delay=0.0005)) as engine:
            async def one(i: int) -> None:
                scheduling = SchedulingParams(request_class="rt" if i % 2 else "be",
                                              tenant=f"t{i % 3}", priority=i % 4)
                results[i] = await engine.complete(prompts[i], SamplingParams(max_tokens=12),
                                                   scheduling=scheduling)

            async with anyio.create_task_group() as tg:
                for i in range(100):
                    tg.start_soon(one, i)
                # every request is in the engine (classes rt and be are bros_no_bicache's; a request
                # arriving later under a policy without them would be refused by design)
                while len((await engine.inspect()).scheduler.live_requests) + \
                        sum(r is not None for r in results) < 100:
                    await anyio.sleep(0.001)
                for text in replacements:
                    await wait_iterations(engine, 5)
                    assert (await engine.inspect()).scheduler.live_requests
                    await engine.replace_policy(text)
                    broken = text.replace(" {\n", " {\n  batch max 0\n", 1)
                    with pytest.raises(PolicyCheckError, match=r"<replacement>:\d+:\d+: batch"):
                        await engine.replace_policy(broken)
            snap = await engine.wait_idle()
    for p, r in zip(prompts, results):
        assert list(r.token_ids) == expected_continuation(p, 12, {EOS})
    assert snap.scheduler.policy == "bros_no_bicache" and snap.allocator.allocated_blocks == 0
    replaced = [e for e in logs if e["event"] == "policy replaced" and e.get("actor") == "engine"]
    assert [e["new"] for e in replaced] == ["priority", "fcfs", "vtc", "round_robin_rtbe",
                                            "kunserve_drop", "bros_no_bicache"]
    assert "+policy priority {" in replaced[0]["diff"]
    assert "-policy bros_no_bicache {" in replaced[0]["diff"]


async def test_a_broken_or_unsupported_replacement_leaves_the_old_policy_running():
    async with Engine.start(CONFIG, backend=fake_backend(64, 4)) as engine:
        before = engine.policy
        with pytest.raises(PolicySyntaxError, match=r"<replacement>:1:29: unexpected character '\$'"):
            await engine.replace_policy("policy p { priority = slack $ }")
        with pytest.raises(PolicyCheckError, match="preempt swap is not supported by this engine"):
            await engine.replace_policy(load_policy_file(policy_path("fastswitch_markov")))
        with pytest.raises(PolicyCheckError, match=r"<replacement>:9:3: preempt swap is not supported"):
            await engine.replace_policy(policy_path("vllm_baseline_markov").read_text(),
                                        base_dir=policy_path("fcfs").parent)
        assert engine.policy is before
        assert (await engine.inspect()).scheduler.policy == "fcfs"
        done = await engine.complete([5, 6, 7], SamplingParams(max_tokens=4))
    assert list(done.token_ids) == expected_continuation([5, 6, 7], 4, {EOS})


async def test_the_engine_starts_with_the_configured_policy_or_fcfs():
    async with Engine.start(CONFIG, backend=fake_backend(16, 4)) as engine:
        assert isinstance(engine.policy, CompiledPolicy)
        assert engine.policy.filename == str(policy_path("fcfs"))
    config = EngineConfig(block_size=4, policy=policy_path("vtc"))
    async with Engine.start(config, backend=fake_backend(16, 4)) as engine:
        assert (await engine.inspect()).scheduler.policy == "vtc"
    async with Engine.start(CONFIG, policy=FcfsPolicy(), backend=fake_backend(16, 4)) as engine:
        assert engine.policy.source == "policy fcfs { }\n"


async def test_an_engine_refuses_at_start_a_policy_it_cannot_run():
    config = EngineConfig(block_size=4, policy=policy_path("groups_random"))
    with pytest.raises(PolicyCheckError) as info:
        async with Engine.start(config, backend=fake_backend(16, 4)):
            pass
    lines = str(info.value).splitlines()
    assert lines[0] == (f"{policy_path('vllm_baseline_markov')}:9:3: preempt swap is not supported "
                        "by this engine (it supports: never, recompute; this engine was started "
                        "with a backend that cannot swap)")
    assert lines[3] == (f"{policy_path('groups_random')}:4:12: swap_granularity groups is not "
                        "supported by this engine (this engine was started with a backend that "
                        "cannot swap)")


SIM = EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=64, cpu_swap_blocks=64)
MISMATCH = ("swap_granularity {} does not match this engine's device allocator, which runs {} (it "
            "follows the policy the engine started with; restart the engine to change it)")


async def test_a_replacement_swapping_at_another_granularity_than_the_allocator_is_refused():
    config = attrs.evolve(SIM, policy=policy_path("groups_markov"))
    async with Engine.start(config) as engine:
        before = engine.policy
        assert engine.capabilities.allocator == "groups"
        with pytest.raises(PolicyCheckError) as info:  # swaps, per-block by inheritance
            await engine.replace_policy(load_policy_file(policy_path("vllm_baseline_random")))
        assert str(info.value) == (
            f"{policy_path('vllm_baseline_markov')}:10:12: {MISMATCH.format('per-block', 'groups')}\n"
            "    memory { swap_granularity per-block; swap_in sync; kv_reuse off }\n"
            "             ^~~~~~~~~~~~~~~~~~~~~~~~~~")
        swaps_by_default = 'policy d extends "fcfs.policy" {\n  preempt swap\n}\n'
        with pytest.raises(PolicyCheckError) as info:  # swaps, per-block by default
            await engine.replace_policy(swaps_by_default, base_dir=policy_path("fcfs").parent)
        assert str(info.value) == (
            f"<replacement>:1:8: {MISMATCH.format('per-block', 'groups')}\n"
            '  policy d extends "fcfs.policy" {\n'
            "         ^")
        assert engine.policy is before
        assert (await engine.inspect()).scheduler.policy == "groups_markov"
        done = await engine.complete([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(done.token_ids) == 3
        # a policy that neither swaps nor names a granularity runs on either allocator
        fcfs = await engine.replace_policy(policy_path("fcfs").read_text(),
                                           base_dir=policy_path("fcfs").parent)
        assert engine.policy is fcfs and fcfs.settings.memory.swap_granularity == "per-block"


async def test_a_replacement_naming_another_granularity_is_refused_even_without_swap():
    async with Engine.start(SIM) as engine:  # the shipped fcfs: the per-block allocator
        before = engine.policy
        assert engine.capabilities.allocator == "per-block"
        text = 'policy g extends "fcfs.policy" {\n  memory { swap_granularity groups }\n}\n'
        with pytest.raises(PolicyCheckError) as info:
            await engine.replace_policy(text, base_dir=policy_path("fcfs").parent)
        assert str(info.value) == (
            f"<replacement>:2:12: {MISMATCH.format('groups', 'per-block')}\n"
            "    memory { swap_granularity groups }\n"
            "             ^~~~~~~~~~~~~~~~~~~~~~~")
        with pytest.raises(PolicyCheckError) as info:  # swaps, groups by inheritance
            await engine.replace_policy(load_policy_file(policy_path("fastswitch_random")))
        assert str(info.value).splitlines()[0] == (
            f"{policy_path('groups_random')}:4:12: {MISMATCH.format('groups', 'per-block')}")
        assert engine.policy is before
        assert (await engine.inspect()).scheduler.policy == "fcfs"
        baseline = await engine.replace_policy(load_policy_file(policy_path("vllm_baseline_random")))
        assert engine.policy is baseline


OVERLOAD = """
policy o extends "fcfs.policy" {
  overload drop when kv_usage > 50% for 2 iterations
  overload restore when kv_usage < 20%
}
"""


async def test_overload_triggers_are_counted_and_logged_when_they_start_and_stop():
    with captured_logs() as logs:
        async with Engine.start(CONFIG, backend=fake_backend(16, 4)) as engine:
            await engine.replace_policy(OVERLOAD, base_dir=policy_path("fcfs").parent)
            big = SamplingParams(max_tokens=6, ignore_eos=True)
            async with anyio.create_task_group() as tg:  # 3 x 16 tokens of 64: 75% used
                for i in range(3):
                    tg.start_soon(engine.complete, [5 + i] * 14, big)
            await engine.complete([9], SamplingParams(max_tokens=3, ignore_eos=True))  # 1 block
            snap = (await engine.inspect()).scheduler
    assert (snap.overload_drops, snap.overload_restores) == (1, 1)
    events = [(e["event"], e["trigger"]) for e in logs if e["event"].startswith("overload")]
    assert events == [("overload trigger fired", "drop"), ("overload trigger stopped firing", "drop"),
                      ("overload trigger fired", "restore"),
                      ("overload trigger stopped firing", "restore")]


async def test_a_class_queue_limit_refuses_requests_beyond_it():
    text = 'policy q extends "fcfs.policy" {\n  class default { max_queued 2 }\n}\n'
    config = EngineConfig(block_size=4, max_num_seqs=1, max_batched_tokens=8)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    async with Engine.start(config, backend=fake_backend(64, 4, step_delay=0.005)) as engine:
        await engine.replace_policy(text, base_dir=policy_path("fcfs").parent)
        running = engine.generate([4], params)
        await running.__anext__()  # it runs; the next three queue behind it (one seat)
        outcomes: list[str] = []

        async def queued(i: int) -> None:
            try:
                await engine.complete([5 + i], params)
                outcomes.append("done")
            except RequestFailedError as exc:
                outcomes.append(str(exc).split(": ", 1)[1])

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(queued, i)
        await running.aclose()
    assert sorted(outcomes) == [
        "class default already has 2 queued requests (max_queued in policy q)", "done", "done"]
