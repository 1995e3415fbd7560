"""The in-process async client: a stream of chunks per request, usable from asyncio and trio."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import anyio
import attrs

from engine.errors import EngineDeadError, RequestFailedError, StreamClosedError
from engine.messages import ClientOutput, Submit
from engine.outputs import Admitted, GenerationChunk, Rejected
from engine.params import SamplingParams, SchedulingParams
from engine.timeline import RequestTimeline


class RequestSink(Protocol):
    """What a stream needs of the engine that serves it (`shunter.engine.Engine`)."""

    async def _submit(self, msg: Submit) -> None: ...

    def _cancel_nowait(self, request_id: int) -> None: ...

    def stopped_reason(self) -> str: ...


@attrs.frozen(kw_only=True)
class Completion:
    """A whole request's result."""

    request_id: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    timeline: RequestTimeline | None


class GenerationStream:
    """`async for chunk in engine.generate(...)`. Leaving the loop, closing the stream or
    cancelling the task that reads it cancels the request and frees its KV blocks. A stream
    closed before its last chunk (`aclose()` from another task) raises StreamClosedError to
    whoever reads it, then or later."""

    def __init__(self, engine: RequestSink, prompt: str | Sequence[int],
                 sampling: SamplingParams, scheduling: SchedulingParams, *,
                 stream: bool = True) -> None:
        self._engine = engine
        self._send, self._recv = anyio.create_memory_object_stream[ClientOutput](math.inf)
        text = prompt if isinstance(prompt, str) else None
        ids = None if isinstance(prompt, str) else prompt
        self._submit = Submit(prompt=text, prompt_ids=ids, sampling=sampling,
                              scheduling=scheduling, outputs=self._send, stream=stream)
        self.request_id: int | None = None
        self._done = False
        self._closed = False  # aclose() before the last chunk

    def __aiter__(self) -> GenerationStream:
        return self

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def __anext__(self) -> GenerationChunk:
        if self._closed:
            raise self._closed_error()
        if self._done:
            raise StopAsyncIteration
        try:
            if self.request_id is None:
                await self._admit()
            try:
                chunk: GenerationChunk = await self._recv.receive()
            except anyio.EndOfStream:
                self._done = True
                raise EngineDeadError(self._engine.stopped_reason()) from None
        except anyio.ClosedResourceError:  # aclose() from another task while this one read
            raise self._closed_error() from None
        except BaseException:
            self._cancel_nowait()
            raise
        if chunk.finish_reason is not None:
            self._done = True
        return chunk

    async def _admit(self) -> None:
        await self._engine._submit(self._submit)
        try:
            answer = await self._recv.receive()
        except anyio.EndOfStream:
            self._done = True
            raise EngineDeadError(self._engine.stopped_reason()) from None
        match answer:
            case Admitted(request_id=rid):
                self.request_id = rid
            case Rejected(error=error):
                self._done = True
                raise error
            case _:  # a chunk before the admission answer would be a token lost: say so
                self._done = True
                raise EngineDeadError(f"the engine broke its protocol: {type(answer).__name__} "
                                      f"before Admitted or Rejected")

    async def aclose(self) -> None:
        if not self._done:
            self._closed = True
        self._cancel_nowait()

    def _closed_error(self) -> StreamClosedError:
        which = ("a request not yet admitted" if self.request_id is None
                 else f"request {self.request_id}")
        return StreamClosedError(f"the stream of {which} was closed (aclose()) before its last "
                                 f"chunk; the request was cancelled")

    def _cancel_nowait(self) -> None:
        if self._done:
            return
        self._done = True
        self._recv.close()
        if self.request_id is not None:
            self._engine._cancel_nowait(self.request_id)

    def __del__(self) -> None:
        try:
            self._cancel_nowait()
        except Exception:  # the loop may be gone at interpreter exit
            pass


async def collect(stream: GenerationStream) -> Completion:
    """Read a stream to its end; a request that ends in error raises RequestFailedError."""
    ids: list[int] = []
    parts: list[str] = []
    last: GenerationChunk | None = None
    async for chunk in stream:
        ids.extend(chunk.token_ids)
        parts.append(chunk.text)
        last = chunk
    assert last is not None and last.finish_reason is not None
    if last.finish_reason == "error":
        raise RequestFailedError(f"request {last.request_id} failed: {last.error}")
    return Completion(request_id=last.request_id, token_ids=tuple(ids), text="".join(parts),
                      finish_reason=last.finish_reason, timeline=last.timeline)
