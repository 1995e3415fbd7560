"""The burst the KunServe simulator tests overload their instances with: request i starts after
i x 5 ms of virtual time, each a 399-token prompt decoding `max_tokens` with EOS ignored."""

from __future__ import annotations

import anyio
import anyio.abc

import shunter

STAGGER_S = 0.005


def start_burst(tg: anyio.abc.TaskGroup, cluster, done: list, n: int, max_tokens: int) -> None:
    """Starts the burst's `n` requests in `tg`; each appends its finished completion to `done`
    (in the order they end)."""
    params = shunter.SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int) -> None:
        await anyio.sleep(i * STAGGER_S)
        done.append(await cluster.complete(list(range(1, 400)), params))

    for i in range(n):
        tg.start_soon(one, i)


def ends_of(done: list) -> list[tuple[str, int]]:
    """(finish reason, tokens out) of each completion."""
    return [(d.finish_reason, len(d.token_ids)) for d in done]
