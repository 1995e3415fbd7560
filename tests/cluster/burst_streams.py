"""The burst the KunServe heartbeat tests drive over two grouped torch instances: two long
requests, then, once each streamed 2 tokens, a burst; the monitor groups them (`until_grouped`)
or the test does (`until_formed`, under `by_hand_policy`); every stream's end is recorded as
(tokens, finish reason, error)."""

from __future__ import annotations

import random

import anyio

import shunter
from tests.cluster.test_kunserve_torch_cluster import LONG_TOKENS, _prompt


def burst_jobs(seed: int = 0):
    """(longs, burst, jobs): the prompts, and every job as (name, prompt, max_tokens)."""
    rng = random.Random(seed)
    longs = [_prompt(rng, 8) for _ in range(2)]
    burst = [_prompt(rng, 16) for _ in range(12)]
    jobs = [*((f"L{i}", p, LONG_TOKENS) for i, p in enumerate(longs)),
            *((f"B{i}", p, 8) for i, p in enumerate(burst))]
    return longs, burst, jobs


class BurstStreams:
    """Streams of `cluster`, their ends in `out[name]`."""

    def __init__(self, cluster, out: dict) -> None:
        self.cluster, self.out = cluster, out
        self.streams: dict = {}

    async def one(self, name: str, prompt, n: int, first: anyio.Event | None = None) -> None:
        tokens: list[int] = []
        async with self.cluster.generate(prompt, shunter.SamplingParams(
                max_tokens=n, temperature=0)) as stream:
            self.streams[name] = stream
            async for chunk in stream:
                tokens += chunk.token_ids
                if first is not None and len(tokens) >= 2:
                    first.set()
                if chunk.finish_reason is not None:
                    self.out[name] = (tokens, chunk.finish_reason, chunk.error)

    async def _start(self, tg, longs, burst) -> None:
        """The long requests in `tg`, then, once each streamed 2 tokens, the burst."""
        firsts = [anyio.Event() for _ in longs]
        for i, p in enumerate(longs):
            tg.start_soon(self.one, f"L{i}", p, LONG_TOKENS, firsts[i])
        for ev in firsts:
            await ev.wait()
        for i, p in enumerate(burst):
            tg.start_soon(self.one, f"B{i}", p, 8)

    async def until_formed(self, tg, longs, burst):
        """Start the requests (`_start`); once the burst was admitted, form the group of
        instances 0 and 1 (head 0) as the monitor would; return (head, group). The cluster's
        policy must not drop by itself (`by_hand_policy`). The monitor saw the burst in one
        round only (its queue lasts about 7 steps): a front door slow at load can miss it."""
        from engine.cluster.drop_plan import GroupPlan

        await self._start(tg, longs, burst)
        names = [f"B{i}" for i in range(len(burst))]
        while any(self.streams.get(k) is None or self.streams[k].request_id is None
                  for k in names):
            await anyio.sleep(0.0005)
        await self.cluster.groups.form(GroupPlan(group_id=1, members=(0, 1),
                                                 layers=(range(2), range(2, 4))))
        ((head, group),) = self.cluster.groups.groups.items()
        return head, group

    async def until_grouped(self, tg, longs, burst):
        """Start the requests (`_start`); return (head, group) once the monitor grouped the
        two instances."""
        await self._start(tg, longs, burst)
        while not self.cluster.groups.groups:
            await anyio.sleep(0.005)
        ((head, group),) = self.cluster.groups.groups.items()
        return head, group
