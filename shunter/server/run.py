"""One generation request answered over HTTP: as one JSON body or as server-sent events.

The answer is an ASGI callable that runs the request while watching two things beside it: the
client (an `http.disconnect` cancels the request, so its KV blocks are freed) and the server's
drain deadline (the request ends with an error saying the server shut down). The first chunk is
awaited before the status line is sent, so a refusal (queue full, prompt too long) is a 4xx even
for a streaming request."""

from __future__ import annotations

import json
from typing import Any

import anyio
import attrs

from engine.errors import ShunterError
from engine.outputs import GenerationChunk
from shunter.client import GenerationStream
from shunter.server.errors import ApiError, from_engine_error, from_failed_request
from shunter.server.protocol import GenerationRequest, Shapes, usage
from shunter.server.state import ServerState

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_SHUT_DOWN = "the server shut down before the request finished"


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


async def send_json(send: Any, status: int, obj: Any, out: _Outcome | None = None) -> None:
    """A whole JSON answer; `out` records how far it went (a part whose send was cut by the
    drain deadline counts as sent: an answer never gets two status lines or two ends)."""
    if out is not None:
        out.started = True
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    if out is not None:
        out.closed = True
    await send({"type": "http.response.body", "body": dumps(obj)})


@attrs.define(eq=False)
class _Outcome:
    admitted: bool = False
    """The engine took the request (it may be cut short before its first chunk)."""
    final: GenerationChunk | None = None
    reason: str = "cancelled"
    why_stopped: str | None = None
    """`disconnect` or `shutdown` when the request was cut short."""
    streaming: bool = False
    """The SSE status line has been sent."""
    started: bool = False
    """A status line has been sent (the answer can no longer be a 503)."""
    closed: bool = False
    """The answer's last part has been sent (`[DONE]`, or the JSON body)."""


class GenerationResponse:
    def __init__(self, state: ServerState, request: GenerationRequest, shapes: Shapes) -> None:
        self._state = state
        self._request = request
        self._shapes = shapes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        state, out = self._state, _Outcome()
        state.enter()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_client, receive, tg.cancel_scope, out)
                tg.start_soon(self._watch_shutdown, tg.cancel_scope, out)
                await self._answer(send, out)
                tg.cancel_scope.cancel()
            if out.why_stopped == "shutdown":
                await self._send_shutdown(send, out)
        finally:
            state.leave()
            if out.admitted:
                state.finished(out.final, out.reason, self._request.scheduling)

    async def _watch_client(self, receive: Any, scope: anyio.CancelScope, out: _Outcome) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        out.why_stopped = "disconnect"
        scope.cancel()

    async def _watch_shutdown(self, scope: anyio.CancelScope, out: _Outcome) -> None:
        await self._state.shutdown.wait()
        out.why_stopped = "shutdown"
        scope.cancel()

    async def _send_shutdown(self, send: Any, out: _Outcome) -> None:
        """End the answer the drain deadline cut: with an error if the request had not ended
        (one that had, its last chunk sent, only lacks the stream's end)."""
        error = ApiError(503, "engine_dead", _SHUT_DOWN)
        if out.closed:
            return
        if out.streaming:
            if out.final is None:
                await _frame(send, error.body())
            await _frame(send, None)
        elif not out.started:
            await send_json(send, 503, error.body())

    async def _answer(self, send: Any, out: _Outcome) -> None:
        r = self._request
        async with GenerationStream(self._state.engine, r.prompt, r.sampling, r.scheduling,
                                    stream=r.stream) as gen:
            try:
                first = await gen.__anext__()
            except anyio.get_cancelled_exc_class():
                out.admitted = gen.request_id is not None
                raise
            except ShunterError as exc:
                if gen.request_id is not None:  # admitted, then the engine died
                    out.admitted, out.reason = True, "error"
                error = from_engine_error(exc)
                await send_json(send, error.status, error.body(), out)
                return
            out.admitted = True
            if first.finish_reason == "error" and not first.token_ids:
                out.final, out.reason = first, "error"
                error = from_failed_request(first.error)
                await send_json(send, error.status, error.body(), out)
            elif r.stream:
                await self._stream(send, gen, first, out)
            else:
                await self._whole(send, first, out)

    async def _whole(self, send: Any, chunk: GenerationChunk, out: _Outcome) -> None:
        out.final, out.reason = chunk, chunk.finish_reason or "error"
        if chunk.finish_reason == "error":
            error = from_failed_request(chunk.error)
            await send_json(send, error.status, error.body(), out)
            return
        use = usage(_prompt_tokens(chunk), len(chunk.token_ids))
        ids = chunk.token_ids if self._request.return_token_ids else None
        await send_json(send, 200, self._shapes.whole(chunk.text, chunk.finish_reason, use, ids),
                        out)

    async def _stream(self, send: Any, gen: GenerationStream, chunk: GenerationChunk,
                      out: _Outcome) -> None:
        shapes = self._shapes
        out.started = out.streaming = True
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        if shapes.chat:
            await _frame(send, shapes.delta("", None, first=True))
        generated = 0
        while True:
            generated += len(chunk.token_ids)
            if chunk.finish_reason == "error":
                out.final, out.reason = chunk, "error"
                await _frame(send, from_failed_request(chunk.error).body())
                break
            ids = chunk.token_ids if self._request.return_token_ids else None
            if chunk.text or ids or chunk.finish_reason is not None:
                await _frame(send, shapes.delta(chunk.text, chunk.finish_reason, token_ids=ids))
            if chunk.finish_reason is not None:
                out.final, out.reason = chunk, chunk.finish_reason
                if self._request.include_usage:
                    await _frame(send, shapes.usage_chunk(usage(_prompt_tokens(chunk), generated)))
                break
            try:
                chunk = await gen.__anext__()
            except ShunterError as exc:
                out.reason = "error"
                await _frame(send, from_engine_error(exc).body())
                break
        out.closed = True
        await _frame(send, None)


async def _frame(send: Any, obj: Any) -> None:
    """One SSE event; None is the closing `[DONE]`."""
    data = b"[DONE]" if obj is None else dumps(obj)
    await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n",
                "more_body": obj is not None})


def _prompt_tokens(chunk: GenerationChunk) -> int:
    return chunk.timeline.prompt_tokens if chunk.timeline is not None else 0
