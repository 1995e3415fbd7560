"""A loopback load test: many concurrent streaming requests through one server (sim engine);
none is lost, each ends with a finish reason and `[DONE]`, and no KV block stays allocated."""

from __future__ import annotations

import json
import resource

import anyio
import httpx
import pytest

from shunter import EngineConfig
from tests.conftest import slow_scale
from tests.shunter.server.conftest import serving

pytestmark = pytest.mark.anyio


def _raise_file_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


@pytest.mark.slow
async def test_concurrent_streams_all_end_and_free_their_blocks():
    n = slow_scale(1000, 100)
    _raise_file_limit(4 * n + 256)
    config = EngineConfig(backend="sim", block_size=16, max_num_seqs=256,
                          max_batched_tokens=4096, max_queued_requests=4 * n)
    reasons: dict[int, str] = {}

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": [1 + i % 50] * (4 + i % 13), "max_tokens": 4 + i % 9,
                "ignore_eos": True, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        tokens, frames = 0, []
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            frames = [line async for line in r.aiter_lines() if line]
        assert frames[-1] == "data: [DONE]"
        events = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
        tokens = sum(len(e["choices"][0].get("token_ids", [])) for e in events if e["choices"])
        finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
        assert events[-1]["usage"]["completion_tokens"] == tokens == body["max_tokens"]
        reasons[i] = finish

    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with serving(config) as s, httpx.AsyncClient(base_url=s.url, limits=limits,
                                                       timeout=120) as http:
        with anyio.fail_after(slow_scale(240, 60)):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, http, i)
            snap = await s.engine.wait_idle()
    assert len(reasons) == n and set(reasons.values()) == {"length"}
    assert snap.allocator.allocated_blocks == 0
