"""What a client asks for: how to sample, and how the request should be scheduled."""

from __future__ import annotations

import math

import attrs

from engine.errors import InvalidRequestError


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How tokens are chosen and when generation stops."""

    max_tokens: int = 64
    """Most tokens to generate; finish reason `length` when reached."""
    temperature: float = 0.0
    """0 means greedy (argmax); otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sums to at least top_p."""
    seed: int | None = None
    """Seeds this request's own generator, so its samples do not depend on its batch mates."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (finish reason `stop`); the model's EOS ids are added
    unless `ignore_eos` is set."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the text returned stops before the first one."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks that need an exact output length)."""
    truncate: bool = False
    """When the prompt plus `max_tokens` cannot fit the KV pool or the model's context, generate
    what fits (finish reason `pool` or `context`, and a warning in the log) instead of refusing
    the request with `RequestTooLongError`."""

    def __attrs_post_init__(self) -> None:
        _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            f"temperature must be a finite number >= 0, got {self.temperature}",
        )
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0")
        _check(all(s != "" for s in self.stop), "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@attrs.frozen(kw_only=True)
class SchedulingParams:
    """How the scheduler should treat a request; the loaded policy gives these their meaning."""

    priority: int = 0
    """Client-given priority; policies that use it treat a larger number as more important."""
    request_class: str | None = None
    """Name of a class the policy declares (e.g. `rt`, `be`); None means the policy's default."""
    tenant: str = "default"
    """User or tenant, for fairness counters."""
    conversation_id: str | None = None
    """Requests of one conversation share it; the turn number is counted by the engine."""
    trace_id: str | None = None
    """The request's identity in a replayed workload (the bench sends `SEED/INDEX`): periodic
    priority updates draw from it, so every policy replaying the workload gives the request the
    same priorities (FastSwitch §4 precomputes them); None: the engine's request id is used."""
    ttft_ms: float | None = None
    """Time-to-first-token deadline overriding the class's one."""
    tpot_ms: float | None = None
    """Time-per-output-token deadline overriding the class's one."""

    def __attrs_post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            _check(value is None or value > 0, f"{name} must be > 0, got {value}")
