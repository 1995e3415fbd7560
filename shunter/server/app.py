"""The Starlette application: OpenAI-compatible routes over one running Engine.

    app = build_app(engine, ServerSettings(api_key="k"))

Per-app state lives in `app.state`: `server` (a ServerState), `engine`, `settings` and
`on_finished`, the hooks told when each request ends (metrics hang on it)."""

from __future__ import annotations

import hmac
import secrets
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from shunter.engine import Engine
from shunter.server.admin import Admin
from shunter.server.metrics import ServerMetrics
from shunter.server.openapi import endpoint as openapi_endpoint
from shunter.server.chat import ChatTemplate, parse_messages
from shunter.server.errors import ApiError, invalid
from shunter.server.protocol import (
    GenerationRequest,
    Shapes,
    field,
    parse_json,
    parse_prompt,
    sampling_params,
    scheduling_params,
    stream_options,
)
from shunter.server.run import GenerationResponse
from shunter.server.settings import ServerSettings
from shunter.server.state import ServerState

VERSION = "0.1.0"
Handler = Callable[[Request], Awaitable[Response]]


def server_of(request: Request) -> ServerState:
    return request.app.state.server


_DISCARD_BYTES = 16 << 20
"""How much of an over-limit body is read and thrown away before answering 413, so that the
client, still sending, reads the answer instead of a reset connection."""


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read in chunks and refused (413) once it passes `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + _DISCARD_BYTES:
        raise _too_large(int(declared), limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size <= limit:
            parts.append(part)
        elif size > limit + _DISCARD_BYTES:
            break
    if size > limit:
        raise _too_large(size, limit)
    return b"".join(parts)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, "body_too_large",
                    f"the body has at least {size} bytes, more than the limit of {limit}")


def api_route(path: str, handler: Handler, methods: Sequence[str], *,
              guarded: bool = True) -> Route:
    """A route whose ApiErrors become OpenAI error objects; `guarded` ones need the API key."""
    async def endpoint(request: Request) -> Response:
        try:
            if guarded:
                check_api_key(request)
            return await handler(request)
        except ApiError as exc:
            return exc.response()
    return Route(path, endpoint, methods=list(methods))


def check_api_key(request: Request) -> None:
    key = server_of(request).settings.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    token = given[7:] if given[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(token.encode(), key.encode()):
        raise ApiError(401, "unauthorized", "a valid API key is needed: "
                       "send 'Authorization: Bearer KEY'")


async def _generation_body(request: Request) -> tuple[ServerState, dict]:
    server = server_of(request)
    body = parse_json(await read_body(request, server.settings.max_body_bytes))
    if (why := server.unavailable()) is not None:
        raise ApiError(503, "engine_dead", why)
    model = field(body, "model", str)
    if model is not None and model != server.model_name:
        raise ApiError(404, "model_not_found", f"model {model!r} is not served here; this "
                       f"server serves {server.model_name!r}", "model")
    return server, body


def _generation(server: ServerState, body: dict, prompt: str | tuple[int, ...],
                default_max_tokens: int) -> GenerationRequest:
    engine = server.engine
    settings = engine.policy.settings
    stream, include_usage = stream_options(body)
    return GenerationRequest(
        prompt=prompt, model=field(body, "model", str), stream=stream,
        include_usage=include_usage,
        return_token_ids=field(body, "return_token_ids", bool, False),
        sampling=sampling_params(body, default_max_tokens, engine.backend.max_context),
        scheduling=scheduling_params(body, tuple(c.name for c in settings.classes),
                                     settings.name))


async def completions(request: Request) -> Response:
    server, body = await _generation_body(request)
    req = _generation(server, body, parse_prompt(body), server.settings.completion_max_tokens)
    shapes = Shapes(chat=False, id=f"cmpl-{secrets.token_hex(12)}", model=server.model_name)
    return GenerationResponse(server, req, shapes)  # type: ignore[return-value]


async def chat_completions(request: Request) -> Response:
    server, body = await _generation_body(request)
    messages = parse_messages(body)
    if server.chat_template is None:
        raise invalid(f"model {server.model_name!r} has no chat template: give one with "
                      "`shunter serve --chat-template FILE`, or use /v1/completions", "messages")
    prompt = server.chat_template.render(messages)
    req = _generation(server, body, prompt, server.settings.chat_max_tokens)
    shapes = Shapes(chat=True, id=f"chatcmpl-{secrets.token_hex(12)}", model=server.model_name)
    return GenerationResponse(server, req, shapes)  # type: ignore[return-value]


async def models(request: Request) -> Response:
    server = server_of(request)
    card = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "shunter",
            "max_model_len": server.engine.backend.max_context}
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request) -> Response:
    why = server_of(request).unavailable()
    if why is None:
        return JSONResponse({"status": "ok"})
    return ApiError(503, "engine_dead", why).response()


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION, "python": sys.version.split()[0]})


def _codec(server: ServerState) -> Any:
    codec = server.engine.backend.codec
    if codec is None:
        raise invalid("this engine has no tokenizer (the sim backend takes token ids only)")
    return codec


async def tokenize(request: Request) -> Response:
    server = server_of(request)
    body = parse_json(await read_body(request, server.settings.max_body_bytes))
    if "messages" in body:
        if server.chat_template is None:
            raise invalid(f"model {server.model_name!r} has no chat template", "messages")
        text = server.chat_template.render(parse_messages(body))
    else:
        text = field(body, "prompt", str)
        if text is None:
            raise invalid("give prompt (a string) or messages", "prompt")
    ids = _codec(server).encode(text)
    return JSONResponse({"tokens": ids, "count": len(ids),
                         "max_model_len": server.engine.backend.max_context})


async def detokenize(request: Request) -> Response:
    server = server_of(request)
    body = parse_json(await read_body(request, server.settings.max_body_bytes))
    tokens = field(body, "tokens", list)
    vocab = server.engine.backend.vocab_size
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool)
                                 and 0 <= t < vocab for t in tokens):
        raise invalid(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
    return JSONResponse({"prompt": _codec(server).decode(tokens)})


async def _not_found(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    if status == 405:
        return ApiError(405, "invalid_request",
                        f"{request.method} is not allowed on {request.url.path}").response()
    return ApiError(404, "not_found", f"no route {request.method} {request.url.path}").response()


async def _internal(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}",
                                   "type": "server_error", "param": None,
                                   "code": "internal_error"}}, status_code=500)


def default_model_name(engine: Engine) -> str:
    return "sim" if engine.config.backend == "sim" else engine.config.model.name


def build_app(engine: Engine, settings: ServerSettings | None = None, *,
              extra_routes: Sequence[BaseRoute] = ()) -> Starlette:
    settings = settings or ServerSettings()
    template = (ChatTemplate.from_file(settings.chat_template) if settings.chat_template
                else ChatTemplate.from_model_dir(engine.config.model))
    server = ServerState(engine=engine, settings=settings, chat_template=template,
                         model_name=settings.served_model_name or default_model_name(engine))
    routes: list[BaseRoute] = [
        api_route("/v1/completions", completions, ["POST"]),
        api_route("/v1/chat/completions", chat_completions, ["POST"]),
        api_route("/v1/models", models, ["GET"]),
        api_route("/tokenize", tokenize, ["POST"]),
        api_route("/detokenize", detokenize, ["POST"]),
        api_route("/health", health, ["GET"], guarded=False),
        api_route("/version", version, ["GET"], guarded=False),
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
    ]
    # --- extra routes (metrics, admin): appended here by build_app's callers ---
    metrics = ServerMetrics(engine, model_name=server.model_name)
    admin = Admin(engine, api_key=settings.api_key)
    routes.extend([*metrics.routes(), *admin.routes()])
    server.on_finished.extend([metrics.on_finished, admin.finished.on_finished])
    routes.extend(extra_routes)
    app = Starlette(routes=routes, exception_handlers={
        HTTPException: _not_found, Exception: _internal})
    app.state.server = server
    app.state.engine = engine
    app.state.settings = settings
    app.state.on_finished = server.on_finished
    app.state.metrics = metrics
    app.state.admin = admin
    return app
