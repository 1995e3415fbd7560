"""What a client receives for one request."""

from __future__ import annotations

import attrs

from engine.errors import AdmissionError
from engine.timeline import RequestTimeline


@attrs.frozen(kw_only=True)
class GenerationChunk:
    """New tokens and text of one request; the last chunk has a finish reason."""

    request_id: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    """`stop`, `length`, `context`/`pool` (a `truncate` request cut at that limit), `cancelled`
    or `error` on the last chunk, else None."""
    error: str | None = None
    """Why the request failed, when finish_reason is `error`."""
    timeline: RequestTimeline | None = None
    """Timings of the whole request, on the last chunk."""


@attrs.frozen(kw_only=True)
class Admitted:
    request_id: int


@attrs.frozen(kw_only=True)
class Rejected:
    error: AdmissionError


ClientOutput = Admitted | Rejected | GenerationChunk
"""What a client's output stream carries: the admission answer, then chunks."""
