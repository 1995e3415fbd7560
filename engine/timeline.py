"""What happened to one request, in engine-clock seconds; the raw material of every metric."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class RequestTimeline:
    request_id: int
    request_class: str
    tenant: str
    conversation_id: str | None
    prompt_tokens: int
    arrival: float
    first_scheduled: float | None
    """When its first tokens were computed (end of queueing)."""
    token_times: tuple[float, ...]
    """When each output token reached the frontend; the first is the TTFT point."""
    finished_at: float
    finish_reason: str
    preemptions: int = 0
    swap_stall_s: float = 0.0
    """Time spent waiting for its KV to be swapped back in."""
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def e2e_s(self) -> float:
        return self.finished_at - self.arrival

    @property
    def tbt_s(self) -> tuple[float, ...]:
        """Every gap between consecutive output tokens."""
        t = self.token_times
        return tuple(b - a for a, b in zip(t, t[1:]))

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None
