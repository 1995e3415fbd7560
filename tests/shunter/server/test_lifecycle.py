"""One HTTP request's end, whatever the interleaving: the answer is driven through its ASGI
callable with a stand-in `send` that holds the server where the test wants it (a client slow to
read, the drain deadline passing), over an engine on the fake model; and `shunter.Client`'s
reading of a stream whose end came with more frames after it."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.params import SamplingParams, SchedulingParams
from shunter.engine import Engine
from shunter.remote import Client, ConnectionLostError
from shunter.server.protocol import GenerationRequest, Shapes
from shunter.server.run import GenerationResponse
from shunter.server.settings import ServerSettings
from shunter.server.state import ServerState
from tests.fakes import expected_continuation, fake_backend
from tests.shunter.server.conftest import serving

pytestmark = pytest.mark.anyio


def _frames(sent: list[dict]) -> list[str]:
    return [m["body"].decode().removeprefix("data: ").strip() for m in sent
            if m["type"] == "http.response.body"]


async def _never_disconnects() -> dict:
    await anyio.sleep_forever()
    raise AssertionError


async def test_a_request_that_ended_before_the_drain_deadline_is_not_reported_cut():
    """Its last chunk was sent, the client was slow to read the rest (the usage, `[DONE]`)
    when the deadline passed: the stream ends with `[DONE]`, no error (before: an
    `engine_dead` "shut down before the request finished" error after its finish frame)."""
    async with Engine.start(EngineConfig(backend="sim", block_size=4),
                            backend=fake_backend()) as engine:
        state = ServerState(engine=engine, settings=ServerSettings(), model_name="fake",
                            chat_template=None)
        ended: list[str] = []
        state.on_finished.append(lambda chunk, reason, scheduling: ended.append(reason))
        request = GenerationRequest(
            prompt=(5, 6, 7), sampling=SamplingParams(max_tokens=3, ignore_eos=True),
            scheduling=SchedulingParams(), model=None, stream=True, include_usage=True,
            return_token_ids=True)
        sent: list[dict] = []
        waited = []

        async def send(message: dict) -> None:
            if state.shutdown.is_set() and not waited:
                try:  # the client reads nothing more for now: the server waits here
                    await anyio.sleep_forever()
                finally:
                    waited.append(message)  # ... until the deadline cancels the wait
            sent.append(message)
            if b'"finish_reason":"length"' in message.get("body", b""):
                state.shutdown.set()  # the drain deadline passes now

        answer = GenerationResponse(state, request, Shapes(chat=False, id="cmpl-1",
                                                           model="fake"))
        with anyio.fail_after(10):
            await answer({"type": "http"}, _never_disconnects, send)
    frames = _frames(sent)
    finish = json.loads(frames[-2])
    assert finish["choices"][0]["finish_reason"] == "length"
    ids = [t for f in frames[:-1] for t in json.loads(f)["choices"][0]["token_ids"]]
    assert ids == expected_continuation([5, 6, 7], 3)
    assert frames[-1] == "[DONE]" and not any('"error"' in f for f in frames)
    assert ended == ["length"]


def _event(ids: list[int], finish: str | None = None) -> str:
    choice = {"index": 0, "text": "", "token_ids": ids, "finish_reason": finish}
    return "data: " + json.dumps({"id": "cmpl-2", "choices": [choice]}) + "\n\n"


_CUT = {"error": {"message": "the server shut down before the request finished",
                  "type": "service_unavailable", "param": None, "code": "engine_dead"}}
STREAMS = {
    # an older server cut by its drain deadline after the last chunk
    "ended then cut": _event([4]) + _event([5], "length") + f"data: {json.dumps(_CUT)}\n\n"
    + "data: [DONE]\n\n",
    "cut": _event([4]) + f"data: {json.dumps(_CUT)}\n\n" + "data: [DONE]\n\n",
}


async def _double(request: Request) -> Response:
    body = await request.json()
    return Response(STREAMS[body["prompt"]].encode(), media_type="text/event-stream")


DOUBLE = Starlette(routes=[Route("/v1/completions", _double, methods=["POST"])])


async def test_the_client_keeps_a_finished_request_whose_stream_was_cut_after_its_end():
    """The last chunk came, then an error frame: the request ended, its tokens are all there
    (before: the held last chunk was dropped and EngineDeadError raised); an error before the
    last chunk still raises."""
    async with Client("http://double", model="m",
                      transport=httpx.ASGITransport(app=DOUBLE)) as client:
        done = await client.complete("ended then cut", SamplingParams(max_tokens=2))
        assert (done.token_ids, done.finish_reason) == ((4, 5), "length")
        with pytest.raises(EngineDeadError, match="shut down before the request finished"):
            await client.complete("cut", SamplingParams(max_tokens=2))


async def test_an_engine_that_stops_mid_request_ends_each_answer_with_its_reason():
    """A streaming answer ends with an `engine_dead` error frame naming the failed actor, then
    `[DONE]`; a whole answer still waited for gets 503 with the same reason."""
    async with serving(EngineConfig(backend="sim")) as s, \
            httpx.AsyncClient(base_url=s.url, timeout=30) as http:
        body = {"prompt": [1, 2], "max_tokens": 5000, "ignore_eos": True,
                "return_token_ids": True}
        frames: list[str] = []
        whole: list[httpx.Response] = []
        streaming = anyio.Event()

        async def stream() -> None:
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line:
                        frames.append(line.removeprefix("data: "))
                        streaming.set()

        async def post() -> None:
            whole.append(await http.post("/v1/completions", json=body))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream)
                tg.start_soon(post)
                await streaming.wait()
                while len((await s.engine.inspect()).scheduler.live_requests) < 2:
                    await anyio.sleep(0.01)
                await s.engine._scheduler_send.send("not a message")  # the scheduler fails
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "engine_dead" and "scheduler actor failed" in error["message"]
    assert whole[0].status_code == 503
    error = whole[0].json()["error"]
    assert error["code"] == "engine_dead" and "scheduler actor failed" in error["message"]


class _DroppedAfter(httpx.AsyncByteStream):
    """A response body whose connection drops after these frames."""

    def __init__(self, frames: str) -> None:
        self._frames = frames.encode()

    async def __aiter__(self):
        yield self._frames
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message")


async def test_the_client_keeps_a_finished_request_whose_connection_dropped_after_its_end():
    """The connection dropped after the last chunk, before the usage and `[DONE]`: the request
    had ended, its tokens are all there (before: ConnectionLostError); a drop before the last
    chunk still raises ConnectionLostError."""
    def handler(request: httpx.Request) -> httpx.Response:
        ended = json.loads(request.content)["prompt"] == "ended"
        frames = _event([4]) + (_event([5], "length") if ended else "")
        return httpx.Response(200, stream=_DroppedAfter(frames),
                              headers={"content-type": "text/event-stream"})

    async with Client("http://double", model="m",
                      transport=httpx.MockTransport(handler)) as client:
        done = await client.complete("ended", SamplingParams(max_tokens=2))
        assert (done.token_ids, done.finish_reason) == ((4, 5), "length")
        with pytest.raises(ConnectionLostError, match="lost the connection"):
            await client.complete("cut short", SamplingParams(max_tokens=2))
