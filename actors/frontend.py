"""The frontend actor: admission, ids, detokenization, stop strings, and streaming to clients.

Each client owns the receive side of an unbounded stream; the frontend never blocks on a slow
client, and a client that went away (its stream closed) has its request cancelled.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from typing import Protocol, assert_never

import anyio
import attrs
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine.errors import (
    AdmissionError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    RequestTooLongError,
)
from engine.messages import (
    AbortRequest,
    AddRequest,
    Cancel,
    FrontendMessage,
    HandOverStreams,
    SchedulerMessage,
    StepOutputs,
    Submit,
    TakeOverStreams,
    TokenOutput,
)
from engine.outputs import Admitted, ClientOutput, GenerationChunk, Rejected

log = structlog.get_logger(actor="frontend")


class Detokenizer(Protocol):
    """One request's incremental detokenizer."""

    def add(self, token_ids: Sequence[int]) -> str:
        """The new text these tokens complete."""

    def finish(self) -> str:
        """The text still held back, at the request's end."""


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def detokenizer(self) -> Detokenizer: ...


@attrs.frozen(kw_only=True)
class Limits:
    vocab_size: int
    max_prompt_tokens: int
    pool_tokens: int
    max_queued_requests: int
    eos_token_ids: tuple[int, ...]
    max_context: int
    """The model's context length (prompt plus output)."""
    block_size: int


@attrs.define(eq=False)
class ClientStream:
    send: MemoryObjectSendStream[ClientOutput]
    detok: Detokenizer | None
    stop: tuple[str, ...]
    text: str = ""
    emitted: int = 0
    stopping: bool = False
    gone: bool = False
    moved: bool = False
    """Taken over from another engine's frontend (KunServe, `TakeOverStreams`) and given no
    output here since: a cancel then may reach this scheduler before the request does, and be
    lost; the first output of such a stream gone meanwhile aborts it again (`_deliver`)."""
    stream: bool = True
    held_ids: list[int] = attrs.field(factory=list)
    """Non-streaming clients: tokens held back until the final chunk."""
    held_text: list[str] = attrs.field(factory=list)

    def hold_back(self) -> int:
        """Characters that may be the start of a stop string, held until they are decided."""
        return max((len(s) for s in self.stop), default=1) - 1


class Frontend:
    name = "frontend"

    def __init__(self, *, codec: TextCodec | None, limits: Limits,
                 inbox: MemoryObjectReceiveStream[FrontendMessage],
                 scheduler: MemoryObjectSendStream[SchedulerMessage]) -> None:
        self._codec = codec
        self._limits = limits
        self._inbox = inbox
        self._scheduler = scheduler
        self._streams: dict[int, ClientStream] = {}
        self._ids = itertools.count(1)

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            async for msg in self._inbox:
                await self._handle(msg)
        finally:
            self._close_all()

    def _close_all(self) -> None:
        """Clients blocked on their streams see the end (the engine tells them why), including
        those whose submission is still queued here; later submissions are refused."""
        for s in self._streams.values():
            s.send.close()
        while True:
            try:
                msg = self._inbox.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            if isinstance(msg, Submit):
                msg.outputs.close()
        self._inbox.close()

    async def _handle(self, msg: FrontendMessage) -> None:
        match msg:
            case Submit():
                await self._submit(msg)
            case Cancel(request_id=rid):
                s = self._streams.get(rid)
                if s is not None and not s.gone:
                    s.gone = True
                    await self._scheduler.send(AbortRequest(request_id=rid, reason="cancelled"))
            case StepOutputs(outputs=outputs):
                for out in outputs:
                    await self._deliver(out)
            case HandOverStreams(request_ids=ids, reply=reply):  # KunServe: to the group's head
                reply.send({rid: self._streams.pop(rid) for rid in ids if rid in self._streams})
            case TakeOverStreams(streams=streams, reply=reply):
                new = {old: next(self._ids) for old in streams}
                self._streams.update({new[old]: s for old, s in streams.items()})
                for s in streams.values():
                    s.moved = True
                reply.send(new)
            case _:
                assert_never(msg)

    async def _submit(self, msg: Submit) -> None:
        try:
            prompt_ids = self._validate(msg)
        except AdmissionError as exc:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                msg.outputs.send_nowait(Rejected(error=exc))
            msg.outputs.close()
            return
        try:
            rid = next(self._ids)
            msg.outputs.send_nowait(Admitted(request_id=rid))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return  # the client went away while its submission waited here
        detok = self._codec.detokenizer() if self._codec else None
        self._streams[rid] = ClientStream(send=msg.outputs, detok=detok, stop=msg.sampling.stop,
                                          stream=msg.stream)
        await self._scheduler.send(AddRequest(
            request_id=rid, prompt_ids=prompt_ids, sampling=msg.sampling,
            scheduling=msg.scheduling, arrival=anyio.current_time(),
            eos_token_ids=self._limits.eos_token_ids))

    def _validate(self, msg: Submit) -> Sequence[int]:
        lim = self._limits
        if len(self._streams) >= lim.max_queued_requests:
            raise QueueFullError(
                f"the engine holds {len(self._streams)} requests, "
                f"max_queued_requests={lim.max_queued_requests}; retry later")
        if (msg.prompt is None) == (msg.prompt_ids is None):
            raise InvalidRequestError("give exactly one of prompt (text) or prompt_ids")
        if msg.prompt is not None:
            if self._codec is None:
                raise InvalidRequestError("this engine has no tokenizer; send prompt_ids")
            ids: Sequence[int] = self._codec.encode(msg.prompt)
        else:
            ids = msg.prompt_ids
            bad = next((t for t in ids if not 0 <= t < lim.vocab_size), None) if isinstance(ids, list | tuple) else None
            if bad is not None:
                raise InvalidRequestError(f"prompt_ids holds {bad}, outside the vocabulary [0, {lim.vocab_size})")
        if len(ids) == 0:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) > lim.max_prompt_tokens:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens, more than max_prompt_tokens={lim.max_prompt_tokens}")
        if len(ids) + 1 > lim.pool_tokens:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the KV pool holds only {lim.pool_tokens} tokens")
        self._check_fits(len(ids), msg)
        return ids

    def _check_fits(self, prompt: int, msg: Submit) -> None:
        """Refuse a request whose prompt plus max_tokens can never fit the KV pool or the
        context: otherwise the scheduler would cut it short at the limit (issue 12). Where the
        client asked for truncation it is admitted and ends with finish reason `pool`/`context`."""
        lim, max_tokens = self._limits, msg.sampling.max_tokens
        total = prompt + max_tokens
        limit = min(lim.pool_tokens, lim.max_context)
        if total <= limit:
            return
        if lim.pool_tokens < lim.max_context:
            holds = (f"the KV pool holds {lim.pool_tokens} tokens (num_blocks="
                     f"{lim.pool_tokens // lim.block_size} x block_size={lim.block_size})")
            fix = "give the engine more blocks"
        else:
            holds = f"the model's context is {lim.max_context} tokens"
            fix = "shorten the prompt"
        if msg.sampling.truncate:
            log.warning("request truncated", prompt_tokens=prompt, max_tokens=max_tokens,
                        generates_at_most=limit - prompt, limit=holds)
            return
        raise RequestTooLongError(
            f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) = {total} tokens, but {holds}: "
            f"{total - limit} too many; lower max_tokens to at most {limit - prompt} or {fix}")

    async def _deliver(self, out: TokenOutput) -> None:
        s = self._streams.get(out.request_id)
        if s is None:
            return
        if s.moved:  # the scheduler has it now: a cancel sent before it did is sent again
            s.moved = False
            if s.gone and out.finish_reason is None:
                await self._scheduler.send(AbortRequest(request_id=out.request_id,
                                                        reason="cancelled"))
        if (out.finish_reason is None and not s.stream and s.detok is None and not s.gone
                and not s.stopping):  # the common case of a replay: held for the last chunk
            s.held_ids.extend(out.token_ids)
            return
        final = out.finish_reason is not None
        was_stopping = s.stopping
        text = self._new_text(s, out, final)
        token_ids = () if was_stopping else out.token_ids
        if not s.stream and not s.gone:
            s.held_ids.extend(token_ids)
            if text:
                s.held_text.append(text)
            if not final:
                token_ids = ()
            else:
                token_ids, text = tuple(s.held_ids), "".join(s.held_text)
        if not s.gone and (s.stream or final):
            chunk = GenerationChunk(
                request_id=out.request_id, token_ids=token_ids,
                text=text, finish_reason=out.finish_reason, error=out.error,
                timeline=out.metrics if final else None)
            try:
                s.send.send_nowait(chunk)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                s.gone = True
                if not final:
                    await self._scheduler.send(AbortRequest(request_id=out.request_id, reason="cancelled"))
        if final:
            s.send.close()
            del self._streams[out.request_id]
        elif s.stopping and not was_stopping and not s.gone:
            await self._scheduler.send(AbortRequest(request_id=out.request_id, reason="stop"))

    def _new_text(self, s: ClientStream, out: TokenOutput, final: bool) -> str:
        """Text to emit now: detokenize, cut at a stop string, hold back a possible stop prefix."""
        if s.detok is None or s.stopping:
            return ""
        s.text += s.detok.add(out.token_ids)
        if final:
            s.text += s.detok.finish()
        end = len(s.text)
        for stop in s.stop:
            at = s.text.find(stop, max(0, s.emitted - len(stop)))
            if at != -1 and at < end:
                end = at
                s.stopping = True
        if not s.stopping and not final:
            end = max(s.emitted, end - s.hold_back())
        delta = s.text[s.emitted:end]
        s.emitted = end
        return delta
