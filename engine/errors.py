"""Exceptions, one class per failure domain.

Messages name the offending value and where it came from, so a user can act on them without
reading the source: "prompt has 5000 tokens, more than max_prompt_tokens=4096".
"""

from __future__ import annotations


class ShunterError(Exception):
    """Base class of every error Shunter raises on purpose."""


class ConfigError(ShunterError):
    """An engine setting is invalid (a bad value, or settings that contradict each other)."""


class ModelLoadError(ShunterError):
    """A model directory cannot be loaded: a missing file, an unknown architecture, a missing
    tensor or a tensor of the wrong shape. The message names the file and, where there is one,
    the tensor."""


class AdmissionError(ShunterError):
    """A request was refused before it entered the engine; no other request is affected."""


class QueueFullError(AdmissionError):
    """The engine already holds as many queued requests as `max_queued_requests` allows."""


class PromptTooLongError(AdmissionError):
    """The prompt (plus the tokens it asks for) does not fit the engine's limits."""


class RequestTooLongError(PromptTooLongError):
    """The prompt plus `max_tokens` can never fit the KV pool or the model's context; the message
    names the limit, the excess and what to change."""


class InvalidRequestError(AdmissionError):
    """The prompt or the sampling parameters are malformed."""


class RequestFailedError(ShunterError):
    """A request was admitted but ended with finish reason `error`; the message says why."""


class StreamClosedError(ShunterError):
    """A request's stream was closed (`aclose()`, usually from another task) before its last
    chunk; the request was cancelled. Raised to whoever still reads the stream, so a reader is
    never left with a stream that ended silently short of its finish reason."""


class EngineDeadError(ShunterError):
    """The engine stopped (an actor failed or the engine shut down) while the request was live."""


class PolicyError(ShunterError):
    """A policy could not be loaded or is not supported by this engine."""


class PolicySyntaxError(PolicyError):
    """A policy file does not parse. The message is `FILE:LINE:COL: message`, then the source
    line and a caret under the offending token."""

    def __init__(self, message: str, *, diagnostics: tuple = ()) -> None:
        super().__init__(message)
        self.diagnostics = diagnostics
        """The structured errors (`policy_lang.diagnostics.Diagnostic`) behind the message."""


class PolicyCheckError(PolicyError):
    """A policy parses but means something wrong: an unknown name, a wrong unit or type, a bad
    include or extends, or a setting this engine does not support. One `FILE:LINE:COL: message`
    block (with source line and caret) per error found."""

    def __init__(self, message: str, *, diagnostics: tuple = ()) -> None:
        super().__init__(message)
        self.diagnostics = diagnostics
