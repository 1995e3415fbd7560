"""The burst the KunServe heartbeat tests drive over two grouped torch instances: two long
requests, then, once each streamed 2 tokens, a burst that makes the monitor group them; every
stream's end is recorded as (tokens, finish reason, error)."""

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

    async def one(self, name: str, prompt, n: int, first: anyio.Event | None = None) -> None:
        tokens: list[int] = []
        async with self.cluster.generate(prompt, shunter.SamplingParams(
                max_tokens=n, temperature=0)) as stream:
            async for chunk in stream:
                tokens += chunk.token_ids
                if first is not None and len(tokens) >= 2:
                    first.set()
                if chunk.finish_reason is not None:
                    self.out[name] = (tokens, chunk.finish_reason, chunk.error)

    async def until_grouped(self, tg, longs, burst):
        """Start the long requests in `tg`, then the burst; return (head, group) once the
        monitor grouped the two instances."""
        firsts = [anyio.Event() for _ in longs]
        for i, p in enumerate(longs):
            tg.start_soon(self.one, f"L{i}", p, LONG_TOKENS, firsts[i])
        for ev in firsts:
            await ev.wait()
        for i, p in enumerate(burst):
            tg.start_soon(self.one, f"B{i}", p, 8)
        while not self.cluster.groups.groups:
            await anyio.sleep(0.005)
        ((head, group),) = self.cluster.groups.groups.items()
        return head, group
