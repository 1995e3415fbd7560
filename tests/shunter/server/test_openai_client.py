"""The official `openai` client against a real server on 127.0.0.1 (tiny random Llama),
under asyncio and trio: completions and chat, streaming or not, usage, stop strings, an early
close that frees the KV blocks, and Shunter's extensions through `extra_body`."""

from __future__ import annotations

import functools

import anyio
import httpx
import openai
import pytest

pytestmark = pytest.mark.anyio


@pytest.fixture
def server(tiny_servers, anyio_backend):
    return tiny_servers.thread(anyio_backend)


@pytest.fixture
async def c(server):
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                  max_retries=0, timeout=60) as c:
        yield c


async def finished_since(server, before: int) -> list:
    """The (reason, scheduling) pairs the server's on_finished hook saw after the first
    `before`, once there is one."""
    with anyio.fail_after(10):
        while len(server.finished) <= before:
            await anyio.sleep(0.01)
    return server.finished[before:]


async def idle_blocks(server) -> dict:
    async with httpx.AsyncClient() as http:
        return (await http.get(server.url + "/test/inspect?idle=1", timeout=30)).json()


async def test_completion_whole_and_streamed_agree_with_usage(server, c):
    whole = await c.completions.create(model="tiny", prompt="def fib(n):", max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert whole.object == "text_completion" and whole.model == "tiny"

    stream = await c.completions.create(model="tiny", prompt="def fib(n):", max_tokens=12,
                                        temperature=0, stream=True,
                                        stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True})
    parts, reasons, usages = [], [], []
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usages.append(chunk.usage)
    assert "".join(parts) == choice.text
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert [(u.prompt_tokens, u.completion_tokens) for u in usages] == [
        (whole.usage.prompt_tokens, 12)]


async def test_token_id_prompt(server, c):
    done = await c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3,
                                                   temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.prompt_tokens == 3 and done.usage.completion_tokens == 3


async def test_chat_whole_and_streamed(server, c):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = await c.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    stream = await c.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == \
        whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_stop_string_ends_the_text_before_it(server, c):
    free = await c.completions.create(model="tiny", prompt="x = 1", max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = text[3:5]
    assert stop.strip() and len(text) > 5
    cut = await c.completions.create(model="tiny", prompt="x = 1", max_tokens=16, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]


async def test_closing_a_stream_early_cancels_it_and_frees_its_blocks(server, c):
    before = len(server.finished)
    stream = await c.completions.create(
        model="tiny", prompt="def f():", max_tokens=240, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    got = 0
    async for chunk in stream:
        got += bool(chunk.choices[0].text)
        if got == 2:
            break
    await stream.close()
    snap = await idle_blocks(server)
    assert snap["allocated"] == 0 and snap["live"] == 0
    [(reason, _)] = await finished_since(server, before)
    assert reason == "cancelled"


async def test_a_client_that_gives_up_cancels_a_whole_request(server, c):
    before = len(server.finished)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(http.post, "/v1/completions", json={
                "prompt": "def f():", "max_tokens": 240, "ignore_eos": True}))
            with anyio.fail_after(20):
                while (await http.get("/test/inspect")).json()["live"] == 0:
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()  # the client hangs up before the answer
    snap = await idle_blocks(server)
    assert snap["allocated"] == 0 and snap["live"] == 0
    [(reason, _)] = await finished_since(server, before)
    assert reason == "cancelled"


async def test_priority_class_and_slos_reach_the_engine(server, c):
    await idle_blocks(server)
    before = len(server.finished)
    await c.completions.create(
        model="tiny", prompt="a", max_tokens=2, extra_body={
            "priority": 7, "request_class": "rt", "ttft_ms": 900, "tpot_ms": 50,
            "tenant": "acme", "conversation_id": "c1", "trace_id": "1/5"})
    [(reason, scheduling)] = await finished_since(server, before)
    assert reason in ("stop", "length")
    assert (scheduling.priority, scheduling.request_class, scheduling.ttft_ms,
            scheduling.tpot_ms, scheduling.tenant, scheduling.conversation_id,
            scheduling.trace_id) == (7, "rt", 900.0, 50.0, "acme", "c1", "1/5")


async def test_refusals_raise_the_openai_exception_types(server, c):
    with pytest.raises(openai.BadRequestError, match="declares rt, be") as info:
        await c.completions.create(model="tiny", prompt="a", max_tokens=2,
                                   extra_body={"request_class": "gold"})
    assert info.value.code == "unknown_request_class"
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported") as info:
        await c.completions.create(model="tiny", prompt="a", max_tokens=2, n=2)
    assert info.value.code == "unsupported"
    with pytest.raises(openai.BadRequestError, match="logprobs are not supported"):
        await c.completions.create(model="tiny", prompt="a", max_tokens=2, logprobs=2)
    with pytest.raises(openai.NotFoundError) as info:
        await c.completions.create(model="gpt-4", prompt="a", max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        await c.completions.create(model="tiny", prompt=list(range(1, 300)) * 10, max_tokens=2)
    assert info.value.code == "prompt_too_long"


async def test_models_and_tokenize_round_trip(server, c):
    models = await c.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    async with httpx.AsyncClient(base_url=server.url) as http:
        ids = (await http.post("/tokenize", json={"prompt": "def add(a, b):"})).json()["tokens"]
        back = (await http.post("/detokenize", json={"tokens": ids})).json()["prompt"]
        assert back == "def add(a, b):"
        chat = (await http.post("/tokenize", json={"messages": [
            {"role": "user", "content": "hi"}]})).json()
        assert chat["count"] == len(chat["tokens"]) > 0
