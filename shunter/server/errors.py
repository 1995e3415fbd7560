"""OpenAI's error object, and how Shunter's exceptions map onto HTTP statuses and error codes.

Every refusal a client can cause is an `ApiError` with a 4xx status; the `code` values are a
contract with `shunter.Client`, which maps them back to exception types."""

from __future__ import annotations

from starlette.responses import JSONResponse

from engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    RequestTooLongError,
    ShunterError,
)

CODES = ("invalid_request", "prompt_too_long", "request_too_long", "unknown_request_class", "unauthorized",
         "not_found", "model_not_found", "body_too_large", "queue_full", "engine_dead",
         "unsupported", "request_failed", "internal_error")
"""Every `code` the server sends."""

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class ApiError(Exception):
    """A request the server refuses, with the status and OpenAI error fields to send."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        assert code in CODES, code
        self.status = status
        self.code = code
        self.message = message
        self.param = param

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, param)


def unsupported(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "unsupported", message, param)


def from_engine_error(exc: ShunterError) -> ApiError:
    """The HTTP form of an error the engine raised while admitting or serving a request."""
    match exc:
        case QueueFullError():
            return ApiError(429, "queue_full", str(exc))
        case RequestTooLongError():
            return ApiError(400, "request_too_long", str(exc), "max_tokens")
        case PromptTooLongError():
            return ApiError(400, "prompt_too_long", str(exc), "prompt")
        case InvalidRequestError():
            return ApiError(400, "invalid_request", str(exc))
        case EngineDeadError():
            return ApiError(503, "engine_dead", str(exc))
        case _:
            return ApiError(500, "request_failed", str(exc))


def from_failed_request(error: str | None) -> ApiError:
    """A request that the engine admitted but ended with finish reason `error`."""
    message = error or "the request failed"
    if "max_queued" in message:  # a class's queue limit (engine/request.py `refusal`)
        return ApiError(429, "queue_full", message)
    return ApiError(500, "request_failed", message)
