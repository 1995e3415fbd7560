"""The names a policy can read, their types (units) and where each may be used.

Durations are held in milliseconds, percentages as fractions (95% is 0.95). A request field maps
to a `RequestView` attribute (times `scale`), or is computed by the runtime (`assigned_priority`
from the last rerank, `tenant_service` from the fairness counters).
"""

from __future__ import annotations

import enum

import attrs


class Type(enum.Enum):
    NUMBER = "a plain number"
    DURATION = "a duration"
    TOKENS = "tokens"
    BLOCKS = "blocks"
    FRACTION = "a percentage"
    ITERATIONS = "iterations"
    TIME = "a point in time"
    STRING = "text"
    BOOL = "a condition"

    @property
    def numeric(self) -> bool:
        return self in (Type.NUMBER, Type.DURATION, Type.TOKENS, Type.BLOCKS, Type.FRACTION,
                        Type.ITERATIONS)

    @property
    def orderable(self) -> bool:
        return self.numeric or self in (Type.TIME, Type.BOOL)


UNIT_TYPES = {None: Type.NUMBER, "ms": Type.DURATION, "s": Type.DURATION, "%": Type.FRACTION,
              "tokens": Type.TOKENS, "blocks": Type.BLOCKS, "iterations": Type.ITERATIONS}
UNIT_SCALE = {"s": 1000.0, "%": 0.01}
"""Literal -> internal value: seconds to milliseconds, percent to a fraction."""

UNIT_HINT = {Type.DURATION: "ms or s", Type.TOKENS: "tokens", Type.BLOCKS: "blocks",
             Type.FRACTION: "%", Type.ITERATIONS: "iterations"}


class Scope(enum.Flag):
    REQUEST = enum.auto()
    """Fields of one request: priority keys and pack conditions."""
    ENGINE = enum.auto()
    """Statistics of the engine this iteration: overload triggers and pack conditions."""
    PACK = enum.auto()
    """The batch being packed: pack conditions only."""


@attrs.frozen(kw_only=True)
class Field:
    name: str
    type: Type
    scope: Scope
    doc: str
    attr: str | None = None
    """RequestView (REQUEST) or SchedulerView (ENGINE) attribute; None: computed."""
    scale: float = 1.0
    values: tuple[str, ...] = ()
    """The values a text field takes, when they are known in advance."""


STATES = ("waiting", "running", "swapped", "swapping_in")

_R, _E, _P = Scope.REQUEST, Scope.ENGINE, Scope.PACK

FIELDS: dict[str, Field] = {f.name: f for f in (
    Field(name="class", type=Type.STRING, scope=_R, attr="request_class",
          doc="the request's class"),
    Field(name="client_priority", type=Type.NUMBER, scope=_R, attr="priority",
          doc="the priority the client gave (larger is more important)"),
    Field(name="tenant", type=Type.STRING, scope=_R, attr="tenant", doc="the user or tenant"),
    Field(name="turn", type=Type.NUMBER, scope=_R, attr="turn",
          doc="the turn in its conversation (1 for the first request)"),
    Field(name="arrival", type=Type.TIME, scope=_R, attr="arrival", doc="when it arrived"),
    Field(name="age", type=Type.DURATION, scope=_R, doc="time since it arrived"),
    Field(name="waited", type=Type.DURATION, scope=_R,
          doc="time since it was last served (or arrived)"),
    Field(name="slack", type=Type.DURATION, scope=_R,
          doc="time left until its next token is due (infinite without a deadline)"),
    Field(name="prompt_tokens", type=Type.TOKENS, scope=_R, attr="prompt_tokens",
          doc="its prompt length"),
    Field(name="output_tokens", type=Type.TOKENS, scope=_R, attr="output_tokens",
          doc="tokens served to it so far"),
    Field(name="context_tokens", type=Type.TOKENS, scope=_R, attr="context_tokens",
          doc="prompt plus output tokens"),
    Field(name="remaining_tokens", type=Type.TOKENS, scope=_R, attr="remaining_tokens",
          doc="tokens to compute before its next token can be sampled"),
    Field(name="max_tokens", type=Type.TOKENS, scope=_R, attr="max_tokens",
          doc="the most tokens it asked for"),
    Field(name="blocks", type=Type.BLOCKS, scope=_R, attr="blocks",
          doc="device KV blocks it holds"),
    Field(name="cached_tokens", type=Type.TOKENS, scope=_R, attr="cached_tokens",
          doc="leading tokens of a waiting request the device prefix cache holds (SGLang's "
              "longest-prefix-match order: cached_tokens desc)"),
    Field(name="swapped_blocks", type=Type.BLOCKS, scope=_R, attr="swapped_blocks",
          doc="its KV blocks swapped out to host memory"),
    Field(name="checkpointed_blocks", type=Type.BLOCKS, scope=_R, attr="checkpointed_blocks",
          doc="its KV blocks checkpointed to host memory"),
    Field(name="preemptions", type=Type.NUMBER, scope=_R, attr="preemptions",
          doc="how often it was preempted"),
    Field(name="state", type=Type.STRING, scope=_R, attr="state", values=STATES,
          doc="waiting, running, swapped or swapping_in"),
    Field(name="assigned_priority", type=Type.NUMBER, scope=_R,
          doc="the priority the last rerank gave it (larger is more important)"),
    Field(name="tenant_service", type=Type.NUMBER, scope=_R,
          doc="weighted tokens served to its tenant (the fairness counter)"),
    Field(name="kv_usage", type=Type.FRACTION, scope=_E, attr="kv_usage",
          doc="the share of device KV blocks in use"),
    Field(name="free_blocks", type=Type.BLOCKS, scope=_E, attr="free_blocks",
          doc="free device KV blocks"),
    Field(name="total_blocks", type=Type.BLOCKS, scope=_E, attr="total_blocks",
          doc="all device KV blocks"),
    Field(name="free_tokens", type=Type.TOKENS, scope=_E, attr="free_tokens",
          doc="tokens the free blocks hold"),
    Field(name="queued_tokens", type=Type.TOKENS, scope=_E, attr="queued_tokens",
          doc="tokens that requests not running still need computed"),
    Field(name="head_tokens", type=Type.TOKENS, scope=_E, attr="head_tokens",
          doc="KV tokens the oldest waiting or swapped request needs (above free_tokens: "
              "memory, not the token budget, holds the queue)"),
    Field(name="pending_tokens", type=Type.TOKENS, scope=_E, attr="pending_tokens",
          doc="KV tokens the running requests still need for their prompts (KV is reserved "
              "chunk by chunk: above free_tokens, prompts will be preempted mid-prefill)"),
    Field(name="waiting", type=Type.NUMBER, scope=_E, doc="requests waiting"),
    Field(name="running", type=Type.NUMBER, scope=_E, doc="requests running"),
    Field(name="last_iteration", type=Type.DURATION, scope=_E, attr="last_iteration_ms",
          doc="how long the last iteration took"),
    Field(name="est_iteration", type=Type.DURATION, scope=_P,
          doc="the predicted time of the batch with this request in it"),
    Field(name="min_slack", type=Type.DURATION, scope=_P,
          doc="the tightest slack in the batch with this request in it, among the requests "
              "that can still make their deadline"),
    Field(name="batch_size", type=Type.NUMBER, scope=_P,
          doc="requests in the batch with this request in it"),
)}


def fields_in(scope: Scope) -> list[str]:
    return [name for name, f in FIELDS.items() if f.scope & scope]


FUNCTIONS = ("min", "max", "abs")

SCOPE_WORDS = {Scope.REQUEST: "request fields", Scope.ENGINE: "engine statistics",
               Scope.PACK: "batch quantities"}
