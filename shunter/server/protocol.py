"""Request bodies in, JSON out: OpenAI's completion and chat shapes, plus Shunter's extensions.

Parsing checks every field's type by hand (a bool is not an int, a float is not a string) and
raises `ApiError` naming the field; unknown fields are ignored, as OpenAI's API does."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import attrs

from engine.errors import InvalidRequestError
from engine.params import SamplingParams, SchedulingParams
from shunter.server.errors import ApiError, invalid, unsupported

_MISSING = object()


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """A parsed `/v1/completions` or `/v1/chat/completions` body."""

    prompt: str | tuple[int, ...]
    sampling: SamplingParams
    scheduling: SchedulingParams
    model: str | None
    stream: bool
    include_usage: bool
    return_token_ids: bool = False
    """Each choice carries its `token_ids` (vLLM's extension of the same name); `shunter.Client`
    asks for them, and a streamed chunk is sent for new tokens even when they add no text."""


def parse_json(raw: bytes) -> dict[str, Any]:
    """A body that must be a JSON object, in UTF-8."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid(f"the body is not valid JSON: {exc.msg} at line {exc.lineno} "
                      f"column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:  # over-long integers, deep nesting
        raise invalid(f"the body is not acceptable JSON: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise invalid(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """`body[name]` if present and not null, checked to be of `kind`; else `default`."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        names = " or ".join(k.__name__ for k in kinds)
        raise invalid(f"{name} must be {names}, got {type(value).__name__}", name)
    return value


def parse_prompt(body: dict) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, str | list) for p in prompt):
        raise unsupported("a batch of prompts is not supported; send one request per prompt",
                          "prompt")
    raise invalid("prompt must be a string or a non-empty list of token ids", "prompt")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
        raise invalid("stop must be a string or a list of at most 16 strings", "stop")
    return tuple(stop)


def _refuse_unsupported(body: dict) -> None:
    n = field(body, "n", int, 1)
    if n != 1:
        raise unsupported(f"n={n} is not supported: Shunter returns one choice per request; "
                          "send n separate requests", "n")
    if field(body, "best_of", int, 1) != 1:
        raise unsupported("best_of is not supported", "best_of")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise unsupported("logprobs are not supported", "logprobs")
    if body.get("echo") not in (None, False):
        raise unsupported("echo is not supported", "echo")
    if body.get("suffix") is not None:
        raise unsupported("suffix is not supported", "suffix")
    for name in ("presence_penalty", "frequency_penalty"):
        if field(body, name, float, 0.0) != 0.0:
            raise unsupported(f"{name} is not supported (only 0)", name)


def sampling_params(body: dict, default_max_tokens: int, max_context: int) -> SamplingParams:
    _refuse_unsupported(body)
    max_tokens = field(body, "max_tokens", int, _MISSING)
    if max_tokens is _MISSING:
        max_tokens = field(body, "max_completion_tokens", int, _MISSING)
    # a client that named no length gets the default or what fits, whichever is less (finish
    # reason `pool` or `context` when that was less), not a refusal for a limit it never chose
    truncate = max_tokens is _MISSING
    if truncate:
        max_tokens = default_max_tokens
    if max_tokens > max_context:
        raise invalid(f"max_tokens={max_tokens} is more than the model's context length "
                      f"{max_context}", "max_tokens")
    top_k = field(body, "top_k", int, 0)
    seed = field(body, "seed", int)
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise invalid("seed must fit in 64 bits", "seed")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=field(body, "temperature", float, 1.0),
            top_p=field(body, "top_p", float, 1.0), top_k=0 if top_k == -1 else top_k,
            seed=seed, stop=_stop(body), ignore_eos=field(body, "ignore_eos", bool, False),
            stop_token_ids=tuple(_token_ids(body, "stop_token_ids")), truncate=truncate)
    except InvalidRequestError as exc:
        raise invalid(str(exc)) from None


def _token_ids(body: dict, name: str) -> list[int]:
    ids = field(body, name, list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in ids):
        raise invalid(f"{name} must be a list of token ids", name)
    return ids


def scheduling_params(body: dict, classes: tuple[str, ...], policy: str) -> SchedulingParams:
    """Shunter's extensions; `priority`: larger is more important."""
    request_class = field(body, "request_class", str)
    if request_class is not None and request_class not in classes:
        raise ApiError(400, "unknown_request_class",
                       f"unknown request_class {request_class!r}: policy {policy} declares "
                       f"{', '.join(classes)}", "request_class")
    priority = field(body, "priority", int, 0)
    if not -(2**31) <= priority < 2**31:
        raise invalid("priority must fit in 32 bits", "priority")
    tenant = field(body, "tenant", str) or field(body, "user", str) or "default"
    try:
        return SchedulingParams(
            priority=priority, request_class=request_class, tenant=tenant,
            conversation_id=field(body, "conversation_id", str),
            trace_id=field(body, "trace_id", str),
            ttft_ms=field(body, "ttft_ms", float), tpot_ms=field(body, "tpot_ms", float))
    except InvalidRequestError as exc:
        raise invalid(str(exc)) from None


def stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = field(body, "stream", bool, False)
    options = field(body, "stream_options", dict, {})
    return stream, field(options, "include_usage", bool, False)


# ---------------------------------------------------------------------------- responses

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@attrs.frozen(kw_only=True)
class Shapes:
    """The JSON a completion or chat request answers with, given its id and model."""

    chat: bool
    id: str
    model: str
    created: int = attrs.field(factory=lambda: int(time.time()))

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, use: dict,
              token_ids: Sequence[int] | None = None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": use}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = list(token_ids)
        return {**self._head("text_completion"), "choices": [choice], "usage": use}

    def delta(self, text: str, finish_reason: str | None, *, first: bool = False,
              token_ids: Sequence[int] | None = None) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if first else (
                {"content": text} if text or finish_reason is None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = list(token_ids)
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, use: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}
