"""Factories for tests: `make_view(**overrides)` and friends."""

from __future__ import annotations

import itertools

from engine.planner import Budget
from engine.policy import Decision, RequestView, SchedulerView

_ids = itertools.count(1)
NOW = 100.0
"""The clock of `make_scheduler_view`."""


def make_view(**overrides: object) -> RequestView:
    """`slack_ms` and `waited_s` (at `NOW`) set the clock-free fields they are computed from."""
    rid = int(overrides.pop("id", next(_ids)))
    if "slack_ms" in overrides:
        overrides["deadline"] = NOW + float(overrides.pop("slack_ms")) / 1000.0  # type: ignore[arg-type]
    if "waited_s" in overrides:
        overrides["last_scheduled_at"] = NOW - float(overrides.pop("waited_s"))  # type: ignore[arg-type]
    fields: dict[str, object] = dict(
        id=rid, request_class="default", priority=0, tenant="default", conversation_id=None,
        turn=1, arrival=float(rid), prompt_tokens=10, max_tokens=16, ttft_ms=None, tpot_ms=None,
    )
    fields.update(overrides)
    return RequestView(**fields)  # type: ignore[arg-type]


def running(blocks: int, computed: int, output: int = 1, **overrides: object) -> RequestView:
    """A decoding request holding `blocks` blocks with `computed` tokens in its KV."""
    return make_view(state="running", blocks=blocks, computed_tokens=computed,
                     output_tokens=output, **overrides)


def make_budget(**overrides: object) -> Budget:
    fields: dict[str, object] = dict(free_blocks=100, total_blocks=100, block_size=4,
                                     max_num_seqs=8, max_batched_tokens=64)
    fields.update(overrides)
    return Budget(**fields)  # type: ignore[arg-type]


def fcfs(*views: RequestView, **kw: object) -> Decision:
    return Decision(order=sorted(views, key=lambda v: v.arrival), **kw)  # type: ignore[arg-type]


def make_scheduler_view(requests: list[RequestView], **overrides: object) -> SchedulerView:
    """A frozen scheduler view over `requests` (a policy's whole input)."""
    fields: dict[str, object] = dict(now=NOW, iteration=1, requests=requests, free_blocks=100,
                                     total_blocks=100, block_size=16, max_num_seqs=64,
                                     max_batched_tokens=512)
    fields.update(overrides)
    return SchedulerView(**fields)  # type: ignore[arg-type]
