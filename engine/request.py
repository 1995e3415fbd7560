"""The scheduler's record of one live request: the view policies read, plus what only the
scheduler needs (tokens, stop conditions, timings)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from engine.params import SamplingParams
from engine.policy import RequestView
from engine.timeline import RequestTimeline


@attrs.define(slots=True, eq=False)
class Request:
    view: RequestView
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    eos_token_ids: tuple[int, ...]
    output_ids: list[int] = attrs.field(factory=list)
    token_times: list[float] = attrs.field(factory=list)
    first_scheduled: float | None = None
    known_to_executor: bool = False
    in_flight: int = 0
    """Tokens being computed by the step in flight (0 when not in it)."""
    aborted: str | None = None
    """Finish reason asked for while the request was in a step in flight."""
    swap_stall_s: float = 0.0
    """Seconds this request waited on swap-ins: steps it was in that stalled for synchronous
    swap-ins or conflicts, and its own asynchronous swap-ins."""
    swap_started: float = 0.0
    """When its asynchronous swap-in was ordered."""

    @property
    def id(self) -> int:
        return self.view.id

    def stop_reason(self, token_id: int, max_context: int) -> str | None:
        """Why generation ends after `token_id` was appended, or None to go on."""
        if token_id in self.stop_ids:
            return "stop"
        if len(self.output_ids) >= self.sampling.max_tokens:
            return "length"
        if self.view.context_tokens >= max_context:
            return "length"
        return None

    def timeline(self, finished_at: float, reason: str) -> RequestTimeline:
        v = self.view
        return RequestTimeline(
            request_id=v.id, request_class=v.request_class, tenant=v.tenant,
            conversation_id=v.conversation_id, prompt_tokens=v.prompt_tokens,
            arrival=v.arrival, first_scheduled=self.first_scheduled,
            token_times=tuple(self.token_times), finished_at=finished_at, finish_reason=reason,
            preemptions=v.preemptions, swap_stall_s=self.swap_stall_s,
            ttft_slo_ms=v.ttft_ms, tpot_slo_ms=v.tpot_ms,
        )
