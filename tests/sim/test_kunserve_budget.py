"""A KunServe group's step budget (engine/cluster/adoption.py `GroupSeat`): each stage gets an
instance's token budget (prefill throughput), but the group runs one instance's number of
sequences. With K times the sequences a group of two admitted more long prompts than its pool
could carry to their end: the planner reserves KV chunk by chunk, so the older prefills took the
blocks back from the newer ones (recompute preemptions, most of them mid-prefill) and every step
decoded twice the sequences (the sharegpt cluster bench: 207 recomputes, P50 TPOT 23.2 ->
46.1 ms, P99 TTFT 18.1 -> 28.4 s)."""

from __future__ import annotations

import anyio
import trio
import trio.testing

import shunter
from engine.config import EngineConfig
from policies import policy_path
from shunter.cluster.cluster import Cluster


async def _long_prompts(n: int):
    # 2 x 300 blocks alone; a group of two: 8,258 blocks (132k tokens). 32 sequences of
    # 2,000 + 600 tokens fit in it (83k); 56 would not (146k). The queue (112k) fits the
    # group's free blocks, so the planner forms it at once (a queue no grouping can hold gets
    # no drop, §4.1's KV-centric fallback)
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300, max_num_seqs=32,
                          max_batched_tokens=1024, policy=policy_path("kunserve"))
    async with Cluster.start(config, instances=2, kind="inprocess") as cluster:
        ends = []

        async def one(i: int) -> None:
            await anyio.sleep(i * 0.001)
            done = await cluster.complete([7 + i % 50] * 2000, shunter.SamplingParams(
                max_tokens=600, ignore_eos=True))
            ends.append((done.finish_reason, len(done.token_ids)))

        async def at_group() -> None:  # the instances alone thrash on 300 blocks: not counted
            while not cluster.groups.counters.groups_formed:
                await anyio.sleep(0.01)
            before.append(sum(s.scheduler.preemptions for s in
                              (await cluster.inspect()).snapshots))

        before: list[int] = []
        with anyio.fail_after(600):  # virtual seconds
            async with anyio.create_task_group() as tg:
                tg.start_soon(at_group)
                for i in range(n):
                    tg.start_soon(one, i)
            snap = await cluster.wait_idle()
        after = sum(s.scheduler.preemptions for s in snap.snapshots)
        return ends, after - before[0], cluster.groups.counters


def test_a_group_runs_one_instance_s_sequences_so_long_prompts_are_not_recomputed():
    ends, grouped_preemptions, counters = trio.run(_long_prompts, 56,
                                    clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(set(ends)) == [("length", 600)] and len(ends) == 56
    assert counters.groups_formed >= 1
    # the bad budget (64 sequences in the group) preempted by recompute here
    assert grouped_preemptions == 0
