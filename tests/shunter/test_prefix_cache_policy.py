"""`memory { prefix_cache on|off }`: refused where the engine cannot honour it, pointing at the
setting; turned on and off while serving (on the simulator: the bookkeeping is the same)."""

from __future__ import annotations

import attrs
import pytest

from policies import policy_path
from policy_lang import compile_policy
from shunter import Engine, EngineConfig, PolicyCheckError, SamplingParams

pytestmark = pytest.mark.anyio

SIM = EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=64, cpu_swap_blocks=64,
                   block_size=16)
ON = 'policy apc extends "fcfs.policy" {\n  memory { prefix_cache on }\n}\n'


def test_block_groups_and_prefix_caching_are_refused_together_at_the_setting():
    text = "policy p {\n  memory { swap_granularity groups; prefix_cache on }\n}\n"
    with pytest.raises(PolicyCheckError) as info:
        compile_policy(text, filename="t.policy")
    assert str(info.value) == (
        "t.policy:2:50: prefix_cache on needs swap_granularity per-block: block groups give "
        "each request contiguous runs of its own, and shared cached blocks would break them up\n"
        "    memory { swap_granularity groups; prefix_cache on }\n"
        "                                                   ^~")


async def test_an_engine_running_block_groups_refuses_a_policy_that_caches_prefixes():
    async with Engine.start(attrs.evolve(SIM, policy=policy_path("groups_markov"))) as engine:
        with pytest.raises(PolicyCheckError) as info:
            await engine.replace_policy(ON, base_dir=policy_path("fcfs").parent)
        assert str(info.value) == (
            "<replacement>:2:12: prefix_cache on does not work with this engine's device "
            "allocator, which runs block groups (it follows the policy the engine started with; "
            "restart the engine with a per-block policy)\n"
            "    memory { prefix_cache on }\n"
            "             ^~~~~~~~~~~~~~~")
        assert engine.policy.settings.name == "groups_markov"


async def test_turned_on_a_repeated_prompt_hits_and_turned_off_the_cache_empties():
    prompt, params = list(range(2, 70)), SamplingParams(max_tokens=4, ignore_eos=True)
    async with Engine.start(SIM) as engine:
        await engine.complete(prompt, params)
        assert (await engine.wait_idle()).allocator.cached_blocks == 0  # off by default
        await engine.replace_policy(ON, base_dir=policy_path("fcfs").parent)
        await engine.complete(prompt, params)
        await engine.complete(prompt + [5], params)
        snap = await engine.wait_idle()
        # 68 + 4 tokens: 4 full blocks published; the second request hits all 4 of them
        assert snap.allocator.cached_blocks == 4 and snap.allocator.allocated_blocks == 0
        counts = snap.scheduler.prefix_cache
        assert (counts.hit_blocks, counts.hit_tokens, counts.queried_tokens) == (4, 64, 68 + 69)
        await engine.replace_policy(policy_path("fcfs").read_text(),
                                    base_dir=policy_path("fcfs").parent)
        await engine.complete([3, 4, 5], params)
        snap = await engine.wait_idle()
        assert snap.allocator.cached_blocks == 0 and snap.scheduler.free_blocks == 64


async def test_metrics_and_the_iteration_log_report_the_hits():
    from shunter.server.metrics import ServerMetrics
    from tests.shunter.server.test_metrics import scrape, value

    prompt, params = list(range(2, 70)), SamplingParams(max_tokens=4, ignore_eos=True)
    config = attrs.evolve(SIM, record_iterations=True)
    async with Engine.start(config, policy=compile_policy(ON, base_dir=policy_path("fcfs").parent)
                            ) as engine:
        metrics = ServerMetrics(engine, model_name="m")
        await engine.complete(prompt, params)
        await engine.complete(prompt, params)
        await engine.wait_idle()
        samples = await scrape(metrics)
        taken = await engine.take_iteration_log()
    # the second request finds 4 of its 4 full blocks (67 of its 68 tokens must leave one)
    assert value(samples, "shunter:prefix_cache_queries_total") == 2 * 68
    assert value(samples, "shunter:prefix_cache_hits_total") == 64
    assert value(samples, "shunter:prefix_cache_block_queries_total") == 2 * 4
    assert value(samples, "shunter:prefix_cache_block_hits_total") == 4
    assert value(samples, "shunter:prefix_cache_blocks") == 4
    assert taken.prefix.as_dict()["token_hit_rate"] == pytest.approx(64 / 136)


async def test_cancelled_and_preempted_requests_sharing_a_prefix_leak_nothing():
    import anyio

    policy = compile_policy('policy churn extends "vllm_prefix_random.policy" {\n'
                            "  every 1 iterations: rerank random(seed = 3)\n}\n",
                            base_dir=policy_path("fcfs").parent)
    config = attrs.evolve(SIM, num_blocks=24, max_num_seqs=6)
    system = list(range(2, 66))  # 4 full blocks every request shares
    async with Engine.start(config, policy=policy) as engine:
        async def one(i: int) -> None:
            params = SamplingParams(max_tokens=40, ignore_eos=True)
            stream = engine.generate(system + [100 + i] * (i % 3 * 9 + 1), params)
            async for n, _ in aenumerate(stream):
                if i % 3 == 0 and n == 2:  # a third leave mid-stream
                    await stream.aclose()
                    return

        async with anyio.create_task_group() as tg:
            for i in range(18):
                tg.start_soon(one, i)
        snap = await engine.wait_idle()
    assert snap.scheduler.preemptions > 0 and snap.scheduler.prefix_cache.hit_blocks >= 4
    assert snap.allocator.allocated_blocks == 0 and snap.allocator.tables == {}
    assert snap.scheduler.free_blocks == 24 and snap.swap.blocks_out > 0


async def aenumerate(stream):
    n = 0
    async for item in stream:
        yield n, item
        n += 1
