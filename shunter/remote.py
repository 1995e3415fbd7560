"""The HTTP client: the in-process Engine's `generate` / `complete` over an OpenAI-compatible
server (Shunter's own, or another such as vLLM), usable from asyncio and trio.

    async with shunter.Client("http://127.0.0.1:8000") as client:
        async for chunk in client.generate("def fib(n):", shunter.SamplingParams(max_tokens=32)):
            print(chunk.text, end="")

Requests go to `/v1/completions` as SSE streams, also for `complete()`, so that every result
carries a timeline taken on the client's clock (`anyio.current_time()`): arrival when the request
is sent, one time per output token as its chunk arrives, and the finish. The bench harness
computes its metrics from these just as it does from the engine's own timelines."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Self

import anyio
import httpx

from engine.errors import (
    AdmissionError,
    EngineDeadError,
    InvalidRequestError,
    PolicyError,
    PromptTooLongError,
    QueueFullError,
    RequestFailedError,
    RequestTooLongError,
    ShunterError,
    StreamClosedError,
)
from engine.outputs import GenerationChunk
from engine.params import SamplingParams, SchedulingParams
from engine.timeline import RequestTimeline
from shunter.client import Completion, collect


class UnauthorizedError(AdmissionError):
    """The server refused the API key (HTTP 401 or 403)."""


class ConnectionLostError(EngineDeadError):
    """The server could not be reached, or the connection dropped while a request was live."""


_ERROR_BY_CODE: dict[str, type[ShunterError]] = {
    "prompt_too_long": PromptTooLongError,
    "request_too_long": RequestTooLongError,
    "queue_full": QueueFullError,
    "engine_dead": EngineDeadError,
    "unauthorized": UnauthorizedError,
    "forbidden": UnauthorizedError,
    "request_failed": RequestFailedError,
    "internal_error": RequestFailedError,
    "policy_error": PolicyError,
    "invalid_request": InvalidRequestError,
    "unknown_request_class": InvalidRequestError,
    "unsupported": InvalidRequestError,
    "body_too_large": InvalidRequestError,
    "not_found": InvalidRequestError,
    "model_not_found": InvalidRequestError,
}
_ERROR_BY_STATUS: dict[int, type[ShunterError]] = {
    400: InvalidRequestError, 401: UnauthorizedError, 403: UnauthorizedError,
    404: InvalidRequestError, 413: InvalidRequestError, 422: InvalidRequestError,
    429: QueueFullError, 503: EngineDeadError,
}


def error_from(status: int, payload: Any, fallback: str) -> ShunterError:
    """The exception an OpenAI error object stands for: by its `code` (Shunter's server), else
    by the HTTP status (any other server); the server's message is kept as it is."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, str):  # some servers send {"error": "message"}
        err = {"message": err}
    err = err if isinstance(err, dict) else {}
    message = str(err.get("message") or fallback)
    cls = _ERROR_BY_CODE.get(str(err.get("code")), _ERROR_BY_STATUS.get(status, RequestFailedError))
    return cls(message)


def completion_body(prompt: str | Sequence[int], params: SamplingParams,
                    scheduling: SchedulingParams, *, model: str | None,
                    extensions: bool) -> dict[str, Any]:
    """The `/v1/completions` request: OpenAI's fields, vLLM's sampling extras (`top_k`,
    `stop_token_ids`, `ignore_eos`, `return_token_ids`) and, unless `extensions` is off,
    Shunter's scheduling fields. Only values that differ from the defaults are sent, so a server
    that knows none of the extras still serves a plain request."""
    body: dict[str, Any] = {
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": params.max_tokens, "temperature": params.temperature,
        "top_p": params.top_p, "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    optional = {"top_k": params.top_k or None, "seed": params.seed,
                "stop": list(params.stop) or None,
                "stop_token_ids": list(params.stop_token_ids) or None,
                "ignore_eos": params.ignore_eos or None}
    if extensions:
        defaults = SchedulingParams()
        optional |= {name: value for name in ("priority", "request_class", "tenant",
                                              "conversation_id", "ttft_ms", "tpot_ms",
                                              "trace_id")
                     if (value := getattr(scheduling, name)) != getattr(defaults, name)}
    body.update((k, v) for k, v in optional.items() if v is not None)
    return body


class Client:
    """`shunter.Client(base_url, api_key=None)`: the same `generate` / `complete` as
    `shunter.Engine`, over HTTP. Use it as `async with shunter.Client(url) as client:`.

    `model` names the served model (default: the first one `/v1/models` lists). With
    `extensions=False` Shunter's scheduling fields are left out, for servers that would
    misread them (vLLM's `priority`, for one, orders the other way round)."""

    def __init__(self, base_url: str, api_key: str | None = None, *, model: str | None = None,
                 extensions: bool = True, connect_timeout_s: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.extensions = extensions
        # no read timeout: a request may wait long in the server's queue before its first token
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, transport=transport,
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._ids = itertools.count()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 scheduling: SchedulingParams | None = None) -> RemoteStream:
        """Stream a request's tokens and text. `prompt` is text or token ids. Leaving the loop
        or `await stream.aclose()` closes the HTTP stream; the server cancels the request."""
        return RemoteStream(self, prompt, params or SamplingParams(),
                            scheduling or SchedulingParams(), request_id=next(self._ids))

    async def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       scheduling: SchedulingParams | None = None) -> Completion:
        """The whole result; a request that ends in error raises RequestFailedError."""
        async with self.generate(prompt, params, scheduling=scheduling) as stream:
            return await collect(stream)

    async def models(self) -> list[str]:
        """The model names the server serves (`GET /v1/models`)."""
        data = await self.request_json("GET", "/v1/models")
        return [str(m["id"]) for m in data.get("data", [])]

    async def served_model(self) -> str | None:
        if self.model is None:
            names = await self.models()
            self.model = names[0] if names else None
        return self.model

    async def request_json(self, method: str, path: str, **kwargs: Any) -> Any:
        """One plain request; an error answer raises the exception its code stands for."""
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self.lost(exc) from None
        payload = _json_or_none(response.content)
        if response.status_code >= 400:
            raise error_from(response.status_code, payload,
                             f"{method} {path}: HTTP {response.status_code}")
        return payload

    # ------------------------------------------------------------ Shunter's admin API

    async def get_policy(self) -> dict[str, Any]:
        """The running policy (`GET /admin/policy`: name, version, source, classes)."""
        return await self.request_json("GET", "/admin/policy")

    async def rollback_policy(self) -> dict[str, Any]:
        """Back to the previous policy (`POST /admin/policy/rollback`)."""
        return await self.request_json("POST", "/admin/policy/rollback")

    async def replace_policy(self, text: str, *, filename: str | None = None) -> dict[str, Any]:
        """Run this policy text from the next iteration on (`PUT /admin/policy`; `filename`
        names it in errors); a policy the server refuses raises PolicyError with its
        `FILE:LINE:COL: message` errors, and the running one stays."""
        params = {"filename": filename} if filename else None
        return await self.request_json("PUT", "/admin/policy", content=text.encode(),
                                       params=params, headers={"Content-Type": "text/plain"})

    def lost(self, exc: BaseException) -> ConnectionLostError:
        what = ("cannot reach the server" if isinstance(exc, httpx.ConnectError)
                else "lost the connection to the server")
        return ConnectionLostError(f"{what} at {self.base_url}: {type(exc).__name__}: {exc}")

    def _open(self, body: dict[str, Any]) -> httpx.Request:
        return self._http.build_request("POST", "/v1/completions", json=body)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        return await self._http.send(request, stream=True)


class RemoteStream:
    """`async for chunk in client.generate(...)`: a GenerationStream read from SSE."""

    def __init__(self, client: Client, prompt: str | Sequence[int], sampling: SamplingParams,
                 scheduling: SchedulingParams, *, request_id: int) -> None:
        self._client = client
        self._prompt, self._sampling, self._scheduling = prompt, sampling, scheduling
        self.request_id = request_id
        """The client's own number for the request (the server's id is `response_id`)."""
        self.response_id: str | None = None
        self._response: httpx.Response | None = None
        self._events: AsyncGenerator[str, None] | None = None
        self._done = False
        self._closed = False  # aclose() before the last chunk
        self._arrival = self._finished_at = 0.0
        self._token_times: list[float] = []
        self._prompt_tokens = 0 if isinstance(prompt, str) else len(prompt)

    def __aiter__(self) -> RemoteStream:
        return self

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def __anext__(self) -> GenerationChunk:
        if self._closed:
            raise self._closed_error()
        if self._done:
            raise StopAsyncIteration
        try:
            if self._response is None:
                await self._start()
            chunk = await self._next_chunk()
        except BaseException as exc:
            await self._shut()
            if self._closed and not isinstance(exc, anyio.get_cancelled_exc_class()):
                raise self._closed_error() from None  # aclose() from another task while we read
            if isinstance(exc, httpx.TransportError):
                raise self._client.lost(exc) from None
            raise
        if chunk.finish_reason is not None:
            await self._shut()
        return chunk

    async def aclose(self) -> None:
        """Close the HTTP stream; a request still running is cancelled by the server. A task
        reading the stream meanwhile, or later, gets StreamClosedError."""
        if not self._done:
            self._closed = True
        await self._shut()

    def _closed_error(self) -> StreamClosedError:
        return StreamClosedError(f"the stream of request {self.request_id} was closed (aclose()) "
                                 f"before its last chunk; the server cancels the request")

    async def _shut(self) -> None:
        self._done = True
        with anyio.CancelScope(shield=True):
            # a generator another task is inside ends with the error the response's close gives it
            if self._events is not None and not self._events.ag_running:
                await self._events.aclose()
            if self._response is not None:
                await self._response.aclose()

    async def _start(self) -> None:
        model = await self._client.served_model()
        body = completion_body(self._prompt, self._sampling, self._scheduling, model=model,
                               extensions=self._client.extensions)
        request = self._client._open(body)
        self._arrival = anyio.current_time()
        self._response = response = await self._client._send(request)
        if response.status_code >= 400:
            await response.aread()
            raise error_from(response.status_code, _json_or_none(response.content),
                             f"POST /v1/completions: HTTP {response.status_code}")
        self._events = _sse_events(response)

    async def _next_chunk(self) -> GenerationChunk:
        """The next chunk with text or tokens; the finish chunk is held until the usage chunk
        (or the end of the stream) so that its timeline has the prompt's token count."""
        assert self._events is not None
        finish: GenerationChunk | None = None
        try:
            async for data in self._events:
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event and finish is not None:
                    break  # the request had ended: an error after its last chunk cannot undo that
                if "error" in event:
                    return self._failed(event)
                now = anyio.current_time()
                self.response_id = event.get("id", self.response_id)
                if usage := event.get("usage"):
                    self._prompt_tokens = usage.get("prompt_tokens", self._prompt_tokens)
                for choice in event.get("choices") or ():
                    chunk = self._chunk(choice, now)
                    if chunk.finish_reason is not None and finish is None:
                        self._finished_at = now
                    if chunk.finish_reason is not None or finish is not None:
                        finish = _merge(finish, chunk)  # held, with any tokens sent after it
                    elif chunk.token_ids or chunk.text:
                        return chunk
        except httpx.TransportError:
            if finish is None:
                raise
            # the connection dropped after the last chunk came: the request had ended
        if finish is None:
            raise ConnectionLostError(
                f"the server at {self._client.base_url} ended request {self.request_id}'s "
                f"stream before it finished")
        return GenerationChunk(request_id=self.request_id, token_ids=finish.token_ids,
                               text=finish.text, finish_reason=finish.finish_reason,
                               timeline=self._timeline(finish.finish_reason))

    def _chunk(self, choice: dict[str, Any], now: float) -> GenerationChunk:
        text = choice.get("text") or ""
        ids = tuple(choice.get("token_ids") or ())
        # a server that sends no ids sends one token per chunk (vLLM, when not asked for ids)
        count = len(ids) if "token_ids" in choice else int(bool(text))
        self._token_times.extend([now] * count)
        return GenerationChunk(request_id=self.request_id, token_ids=ids, text=text,
                               finish_reason=choice.get("finish_reason"))

    def _failed(self, event: dict[str, Any]) -> GenerationChunk:
        """An error frame mid-stream: the engine died (raised, as in-process), or this request
        failed (a last chunk with finish reason `error`)."""
        exc = error_from(200, event, "the server reported an error")
        if isinstance(exc, EngineDeadError):
            raise exc
        return GenerationChunk(request_id=self.request_id, token_ids=(), text="",
                               finish_reason="error", error=str(exc),
                               timeline=self._timeline("error"))

    def _timeline(self, reason: str) -> RequestTimeline:
        s = self._scheduling
        return RequestTimeline(
            request_id=self.request_id, request_class=s.request_class or "default",
            tenant=s.tenant, conversation_id=s.conversation_id,
            prompt_tokens=self._prompt_tokens, arrival=self._arrival, first_scheduled=None,
            token_times=tuple(self._token_times),
            finished_at=self._finished_at or anyio.current_time(),
            finish_reason=reason, ttft_slo_ms=s.ttft_ms, tpot_slo_ms=s.tpot_ms)


def _merge(first: GenerationChunk | None, then: GenerationChunk) -> GenerationChunk:
    if first is None:
        return then
    return GenerationChunk(request_id=first.request_id, token_ids=first.token_ids + then.token_ids,
                           text=first.text + then.text,
                           finish_reason=first.finish_reason or then.finish_reason)


async def _sse_events(response: httpx.Response) -> AsyncGenerator[str, None]:
    """The `data` of each server-sent event (lines joined by newlines, as the SSE spec says)."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


def _json_or_none(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None
