"""Every error the server sends, as OpenAI error objects with the agreed codes, on a sim engine
(token-id prompts); and /health while serving, draining and after an actor failed."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

from shunter import EngineConfig
from shunter.server import ServerSettings
from tests.shunter.server.conftest import serving

pytestmark = pytest.mark.anyio

SIM = EngineConfig(backend="sim", block_size=16)


def error_of(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


BAD_BODIES = [
    (b'{"prompt": [1, 2', "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "JSON"),
    (b'{"prompt": [1], "max_tokens": 1' + b"0" * 5000 + b"}", "JSON"),
    (json.dumps({"prompt": [1], "max_tokens": "ten"}).encode(), "max_tokens must be int"),
    (json.dumps({"prompt": [1], "max_tokens": True}).encode(), "max_tokens must be int"),
    (json.dumps({"prompt": [1], "max_tokens": -5}).encode(), "max_tokens must be at least 1"),
    (json.dumps({"prompt": [1], "max_tokens": 10**30}).encode(), "context length"),
    (json.dumps({"prompt": [1], "temperature": "hot"}).encode(), "temperature must be float"),
    (json.dumps({"prompt": [1], "temperature": -1}).encode(), "temperature must be"),
    (json.dumps({"prompt": [1], "top_p": 2}).encode(), "top_p must be"),
    (json.dumps({"prompt": [1], "stream": "yes"}).encode(), "stream must be bool"),
    (json.dumps({"prompt": [1], "priority": 1.5}).encode(), "priority must be int"),
    (json.dumps({"prompt": [1], "ttft_ms": -3}).encode(), "ttft_ms must be > 0"),
    (json.dumps({"prompt": [1], "stop": [1]}).encode(), "stop must be"),
    (json.dumps({"prompt": 5}).encode(), "prompt must be"),
    (json.dumps({"prompt": []}).encode(), "prompt must be"),
    (json.dumps({"prompt": [-1]}).encode(), "outside the vocabulary"),
    (json.dumps({"max_tokens": 3}).encode(), "prompt must be"),
]


async def test_malformed_bodies_get_400_invalid_request():
    async with serving(SIM) as s, httpx.AsyncClient(base_url=s.url) as http:
        for body, message in BAD_BODIES:
            r = await http.post("/v1/completions", content=body,
                                headers={"content-type": "application/json"})
            assert message in error_of(r, 400, "invalid_request")["message"], body[:60]
        ok = await http.post("/v1/completions", json={
            "prompt": [1, 2], "max_tokens": 2, "frobnicate": {"x": 1}, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        r = await http.post("/v1/completions", json={"prompt": "text", "max_tokens": 2})
        assert "no tokenizer" in error_of(r, 400, "invalid_request")["message"]
        r = await http.post("/v1/completions", json={"prompt": ["a", "b"]})
        assert "batch of prompts" in error_of(r, 400, "unsupported")["message"]


async def test_routes_models_and_methods():
    async with serving(SIM) as s, httpx.AsyncClient(base_url=s.url) as http:
        error_of(await http.get("/v2/nothing"), 404, "not_found")
        r = await http.post("/v1/completions", json={"model": "other", "prompt": [1]})
        assert "'other' is not served here" in error_of(r, 404, "model_not_found")["message"]
        assert (await http.get("/v1/completions")).status_code == 405
        assert (await http.get("/version")).json()["version"]
        assert (await http.get("/openapi.json")).json()["paths"]["/v1/completions"]


async def test_bodies_over_the_limit_get_413_without_being_read():
    async with serving(SIM, ServerSettings(max_body_bytes=4096)) as s, \
            httpx.AsyncClient(base_url=s.url) as http:
        r = await http.post("/v1/completions", json={"prompt": [1] * 10_000})
        assert "limit of 4096" in error_of(r, 413, "body_too_large")["message"]

        async def chunked():  # no content-length: the limit is found while reading
            for _ in range(64):
                yield b" " * 1024

        r = await http.post("/v1/completions", content=chunked())
        error_of(r, 413, "body_too_large")
        assert (await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
                ).status_code == 200


async def test_api_key_guards_everything_but_health_and_version():
    async with serving(SIM, ServerSettings(api_key="sesame")) as s, \
            httpx.AsyncClient(base_url=s.url) as http:
        body = {"prompt": [1], "max_tokens": 1}
        error_of(await http.post("/v1/completions", json=body), 401, "unauthorized")
        wrong = {"authorization": "Bearer open"}
        error_of(await http.post("/v1/completions", json=body, headers=wrong), 401,
                 "unauthorized")
        error_of(await http.get("/v1/models", headers=wrong), 401, "unauthorized")
        right = {"authorization": "Bearer sesame"}
        assert (await http.post("/v1/completions", json=body, headers=right)).status_code == 200
        assert (await http.get("/health")).status_code == 200


async def test_a_full_queue_gets_429_and_the_stream_holding_it_is_freed_on_close():
    async with serving(EngineConfig(backend="sim", max_queued_requests=1)) as s, \
            httpx.AsyncClient(base_url=s.url, timeout=30) as http:
        long = {"prompt": [1, 2], "max_tokens": 5000, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        async with http.stream("POST", "/v1/completions", json=long) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            assert (await lines.__anext__()).startswith("data: {")
            r = await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
            assert "max_queued_requests=1" in error_of(r, 429, "queue_full")["message"]
        with anyio.fail_after(10):
            snap = await s.engine.wait_idle()
        assert snap.allocator.allocated_blocks == 0


async def test_chat_without_a_template_is_refused(tiny_llama_dir):
    config = EngineConfig(backend="sim", model=tiny_llama_dir)
    async with serving(config) as s, httpx.AsyncClient(base_url=s.url) as http:
        r = await http.post("/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "hi"}]})
        assert "has no chat template" in error_of(r, 400, "invalid_request")["message"]
        r = await http.post("/v1/chat/completions", json={"messages": "hi"})
        assert "messages must be a non-empty list" in error_of(r, 400, "invalid_request")["message"]


async def test_a_dead_engine_answers_503_on_health_and_requests():
    async with serving(SIM) as s, httpx.AsyncClient(base_url=s.url) as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        await s.engine._scheduler_send.send("not a message")  # the scheduler fails on it
        with anyio.fail_after(10):
            while s.engine.failure is None:
                await anyio.sleep(0.01)
        assert "scheduler actor failed" in error_of(await http.get("/health"), 503,
                                                    "engine_dead")["message"]
        r = await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert "scheduler actor failed" in error_of(r, 503, "engine_dead")["message"]


async def test_draining_refuses_new_requests_and_cuts_the_rest_at_the_deadline():
    async with serving(SIM) as s, httpx.AsyncClient(base_url=s.url, timeout=30) as http:
        state = s.app.state.server
        ended: list[str] = []
        state.on_finished.append(lambda chunk, reason, sched: ended.append(reason))
        long = {"prompt": [1, 2], "max_tokens": 5000, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        short = {"prompt": [3], "max_tokens": 20, "ignore_eos": True}
        frames: list[str] = []
        results: dict[str, httpx.Response] = {}

        async def stream_long() -> None:
            async with http.stream("POST", "/v1/completions", json=long) as r:
                frames.extend([line async for line in r.aiter_lines() if line])

        async def post_short() -> None:
            results["short"] = await http.post("/v1/completions", json=short)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream_long)
            tg.start_soon(post_short)
            with anyio.fail_after(10):
                while state.live < 2:
                    await anyio.sleep(0.01)
            tg.start_soon(state.drain, 2.0)  # alone the short one takes 0.2 s, the long one 50 s
            await anyio.sleep(0.05)
            error_of(await http.get("/health"), 503, "engine_dead")
            r = await http.post("/v1/completions", json=short)
            assert "shutting down" in error_of(r, 503, "engine_dead")["message"]
        assert results["short"].json()["choices"][0]["finish_reason"] == "length"
        assert frames[-1] == "data: [DONE]"
        last = json.loads(frames[-2].removeprefix("data: "))
        assert last["error"]["code"] == "engine_dead" and "shut down" in last["error"]["message"]
        assert sorted(ended) == ["cancelled", "length"]
        with anyio.fail_after(10):
            assert (await s.engine.wait_idle()).allocator.allocated_blocks == 0
