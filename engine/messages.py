"""Typed messages between actors, grouped by the actor that receives them.

Commands are imperative (`AddRequest`, `RunStep`), events are past tense (`StepFinished`).
Messages carry ids and numbers, never tensors; one iteration costs O(1) messages: the scheduler
sends one `RunStep` to the allocator, which sends one `ExecuteStep` to the executor, which answers
the scheduler with one `StepFinished` and the frontend gets one `StepOutputs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from engine.params import SamplingParams, SchedulingParams
from engine.reply import Reply

# ---------------------------------------------------------------------------------- frontend


@attrs.frozen(kw_only=True)
class Submit:
    """A client asks for a generation; `outputs` receives `Admitted`/`Rejected`, then chunks."""

    prompt: str | None
    prompt_ids: Sequence[int] | None
    sampling: SamplingParams
    scheduling: SchedulingParams
    outputs: Any
    """The send side of the client's unbounded output stream."""


@attrs.frozen(kw_only=True)
class Cancel:
    """The client gave up on a request (left the loop, was cancelled, or disconnected)."""

    request_id: int


@attrs.frozen(kw_only=True)
class TokenOutput:
    """New tokens of one request in one iteration."""

    request_id: int
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    """`stop`, `length`, `cancelled` or `error` on the request's last output."""
    error: str | None = None
    metrics: Any = None
    """`engine.timeline.RequestTimeline` on the last output."""


@attrs.frozen(kw_only=True)
class StepOutputs:
    """Everything one iteration produced for clients, in one message."""

    time: float
    outputs: tuple[TokenOutput, ...]


FrontendMessage = Submit | Cancel | StepOutputs

# --------------------------------------------------------------------------------- scheduler


@attrs.frozen(kw_only=True)
class AddRequest:
    """An admitted request enters the scheduler's waiting queue."""

    request_id: int
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    scheduling: SchedulingParams
    arrival: float
    eos_token_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class AbortRequest:
    """End a request early: a cancelled client (`cancelled`) or a stop string seen (`stop`)."""

    request_id: int
    reason: str


@attrs.frozen(kw_only=True)
class SampledToken:
    request_id: int
    token_id: int


@attrs.frozen(kw_only=True)
class StepFinished:
    """The executor ran a step; one token for each sequence that asked to sample."""

    step_id: int
    sampled: tuple[SampledToken, ...]
    compute_s: float
    """Seconds the forward pass and sampling took (on the worker thread or simulated)."""


@attrs.frozen(kw_only=True)
class StepFailed:
    """The step raised; every request in it ends with finish reason `error`."""

    step_id: int
    error: str


@attrs.frozen(kw_only=True)
class InspectScheduler:
    """Ask for a snapshot of the scheduler's queues (tests, the REPL, `/metrics`)."""

    reply: Reply


@attrs.frozen(kw_only=True)
class ReplacePolicy:
    """Switch to another compiled policy at the next iteration boundary."""

    policy: Any
    reply: Reply


SchedulerMessage = (
    AddRequest | AbortRequest | StepFinished | StepFailed | InspectScheduler | ReplacePolicy
)

# --------------------------------------------------------------------------------- allocator


@attrs.frozen(kw_only=True)
class SeqWork:
    """One sequence's share of a step: compute tokens [start, start + num_tokens)."""

    request_id: int
    start: int
    num_tokens: int
    sample: bool
    """Sample a token after this step (the last known token is being processed)."""


@attrs.frozen(kw_only=True)
class RequestSetup:
    """What the executor keeps for a request it has not seen before."""

    request_id: int
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class RunStep:
    """The scheduler's whole plan for one iteration, sent to the allocator.

    The allocator first frees, then grows every request in `grow` to the given number of device
    blocks, then forwards an `ExecuteStep` carrying the new block ids.
    """

    step_id: int
    release: tuple[int, ...]
    """Requests that end: their blocks go back, and the executor forgets them."""
    preempt: tuple[int, ...]
    """Requests preempted by recompute: their blocks go back; they keep their tokens."""
    grow: tuple[tuple[int, int], ...]
    """(request_id, device blocks it must hold after this step)."""
    setups: tuple[RequestSetup, ...]
    seqs: tuple[SeqWork, ...]


@attrs.frozen(kw_only=True)
class InspectAllocator:
    reply: Reply


AllocatorMessage = RunStep | InspectAllocator

# ---------------------------------------------------------------------------------- executor


@attrs.frozen(kw_only=True)
class BlockUpdate:
    """Change to one request's block table on the executor."""

    request_id: int
    reset: bool
    """Drop the current table first (the request was preempted by recompute)."""
    append: tuple[int, ...]


@attrs.frozen(kw_only=True)
class ExecuteStep:
    step_id: int
    release: tuple[int, ...]
    setups: tuple[RequestSetup, ...]
    blocks: tuple[BlockUpdate, ...]
    seqs: tuple[SeqWork, ...]


ExecutorMessage = ExecuteStep
