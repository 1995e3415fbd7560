"""The OpenAPI description served at /openapi.json (what the fuzz test generates requests from)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer"},
    "temperature": {"type": "number"},
    "top_p": {"type": "number"},
    "top_k": {"type": "integer"},
    "seed": {"type": "integer"},
    "stop": _STOP,
    "ignore_eos": {"type": "boolean"},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object",
                       "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": "integer"},
    "logprobs": {},
    "priority": {"type": "integer", "description": "larger is more important"},
    "request_class": {"type": "string"},
    "ttft_ms": {"type": "number"},
    "tpot_ms": {"type": "number"},
    "tenant": {"type": "string"},
    "conversation_id": {"type": "string"},
    "trace_id": {"type": "string", "description": "a replayed workload's request id: periodic "
                 "priority updates draw from it (the same priorities under every policy)"},
}
_PROMPT = {"oneOf": [{"type": "string"},
                     {"type": "array", "items": {"type": "integer"}, "minItems": 1}]}
_MESSAGES = {"type": "array", "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"type": "string"}, "content": {"type": "string"}}}}
_ERROR = {"description": "an OpenAI error object", "content": {"application/json": {"schema": {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"]}}}}}}


def _post(summary: str, properties: dict, required: list[str]) -> dict:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": {"description": "OK"}, "400": _ERROR, "401": _ERROR,
                      "404": _ERROR, "413": _ERROR, "429": _ERROR, "503": _ERROR}}}


def _get(summary: str) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"},
                                                      "503": _ERROR}}}


SCHEMA = {
    "openapi": "3.0.3",
    "info": {"title": "Shunter", "version": "0.1.0"},
    "paths": {
        "/v1/completions": _post("a completion", {**_SAMPLING, "prompt": _PROMPT}, ["prompt"]),
        "/v1/chat/completions": _post("a chat completion",
                                      {**_SAMPLING, "messages": _MESSAGES}, ["messages"]),
        "/tokenize": _post("text to token ids", {"prompt": {"type": "string"}}, ["prompt"]),
        "/detokenize": _post("token ids to text",
                             {"tokens": {"type": "array", "items": {"type": "integer"}}},
                             ["tokens"]),
        "/v1/models": _get("the served model"),
        "/health": _get("200 while serving, 503 with the reason otherwise"),
        "/version": _get("the server's version"),
    },
}


async def endpoint(request: Request) -> JSONResponse:
    return JSONResponse(SCHEMA)
