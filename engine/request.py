"""The scheduler's record of one live request: everything about it that changes (state, tokens,
blocks, timings) and what only the scheduler needs (stop conditions, the executor's setup).
Policies never see it: each iteration `view(now)` freezes it into a `RequestView`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter

import attrs

from engine.messages import AddRequest
from engine.params import SamplingParams
from engine.policy import PolicySettings, RequestState, RequestView, token_deadline
from engine.timeline import RequestTimeline

_new_view = tuple.__new__


@attrs.define(slots=True, eq=False, kw_only=True)
class Request:
    id: int
    request_class: str
    priority: int
    """Client-given priority (larger is more important)."""
    tenant: str
    conversation_id: str | None
    turn: int
    """1 for a conversation's first request, 2 for the next, ..."""
    arrival: float
    """Engine clock, seconds."""
    ttft_ms: float | None
    """Effective time-to-first-token deadline (request's own, else its class's)."""
    tpot_ms: float | None
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    """Token ids that end generation with `stop` (the client's, plus EOS unless ignored)."""
    eos_token_ids: tuple[int, ...]
    state: RequestState = "waiting"
    computed_tokens: int = 0
    """Tokens whose KV is on the device (or, while swapped, on the host)."""
    blocks: int = 0
    """Device KV blocks held: the scheduler's free count is the total minus these."""
    swapped_blocks: int = 0
    """KV blocks held in host swap space, to be swapped in."""
    checkpointed_blocks: int = 0
    """Blocks with KV slots lazily checkpointed on the host (BROS §5.2), to swap back in."""
    checkpointed_slots: int = 0
    """Those slots (BROS's lazy checkpoints copy slots, not blocks)."""
    preemptions: int = 0
    output_ids: list[int] = attrs.field(factory=list)
    token_times: list[float] = attrs.field(factory=list)
    """Engine clock when each output token was delivered."""
    first_token_at: float | None = None
    last_token_at: float | None = None
    last_scheduled_at: float | None = None
    """When a step it was in last finished."""
    first_scheduled: float | None = None
    """When it was first put in a step."""
    known_to_executor: bool = False
    """Its `RequestSetup` went out in an earlier step."""
    in_flight_tokens: int = 0
    """Tokens being computed by the step in flight (0 when not in it)."""
    abort_reason: str | None = None
    """Finish reason asked for while the request was in a step in flight."""
    swap_stall_s: float = 0.0
    """Seconds this request waited on swap-ins: steps it was in that stalled for synchronous
    swap-ins or conflicts, and its own asynchronous swap-ins."""
    swap_started: float = 0.0
    """When its asynchronous swap-in was ordered."""
    trace_id: str | None = None
    """`SchedulingParams.trace_id`."""
    # derived, kept current by the transitions below: read for every live request every
    # iteration, where recomputing them cost the simulator's hour-long replays about 10%
    _prompt_len: int = attrs.field(init=False, default=0)
    _deadline: float = attrs.field(init=False, default=0.0)
    _view: RequestView | None = attrs.field(init=False, default=None)
    """The view last built, until a transition (or `changed`) drops it."""

    def __attrs_post_init__(self) -> None:
        self._prompt_len = len(self.prompt_ids)
        self._deadline = self._due()

    @classmethod
    def admit(cls, msg: AddRequest, settings: PolicySettings, turn: int) -> Request:
        """A new waiting request; deadlines it leaves out come from its class in `settings`."""
        sched = msg.scheduling
        spec = settings.class_spec(sched.request_class)
        stop = set(msg.sampling.stop_token_ids)
        if not msg.sampling.ignore_eos:
            stop.update(msg.eos_token_ids)
        return cls(
            id=msg.request_id, request_class=spec.name if spec else str(sched.request_class),
            priority=sched.priority, tenant=sched.tenant, conversation_id=sched.conversation_id,
            turn=turn, arrival=msg.arrival,
            ttft_ms=sched.ttft_ms or (spec.ttft_ms if spec else None),
            tpot_ms=sched.tpot_ms or (spec.tpot_ms if spec else None),
            prompt_ids=msg.prompt_ids, sampling=msg.sampling, stop_ids=frozenset(stop),
            eos_token_ids=msg.eos_token_ids, trace_id=sched.trace_id)

    @property
    def prompt_tokens(self) -> int:
        return self._prompt_len

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def context_tokens(self) -> int:
        return self._prompt_len + len(self.output_ids)

    def next_deadline(self) -> float:
        """When the next token is due (engine clock, seconds); inf without a deadline."""
        return self._deadline

    def _due(self) -> float:
        return token_deadline(self.arrival, self.ttft_ms, self.tpot_ms, self.first_token_at,
                              len(self.output_ids))

    def view(self) -> RequestView:
        """The frozen record a policy reads: kept until the request changes, since every live
        request's view is read every iteration (rebuilding them all was a fifth of an
        hour-long simulator replay). Every transition below drops it; code that sets a field
        itself calls `changed`."""
        view = self._view
        if view is None:
            # every field positionally, in RequestView's order (checked field by field in
            # tests/engine/test_request.py), through tuple.__new__: the named tuple's own
            # __new__ is a Python function, and ~100 views are built each iteration
            view = self._view = _new_view(RequestView, (
                self.id, self.request_class, self.priority, self.tenant, self.conversation_id,
                self.turn, self.arrival, self._prompt_len, self.sampling.max_tokens,
                self.ttft_ms, self.tpot_ms, self.state, len(self.output_ids),
                self.computed_tokens, self.blocks, self.swapped_blocks, self.checkpointed_blocks,
                self.preemptions, self.first_token_at, self.last_token_at,
                self.last_scheduled_at, self._deadline, self.trace_id, 0, 0, 0))
        return view

    def changed(self) -> None:
        """A field was set from outside the transitions below: the next `view` is rebuilt."""
        self._view = None

    # ------------------------------------------------------------------------ transitions

    def schedule(self, tokens: int, blocks: int, now: float) -> None:
        """It computes `tokens` tokens in the step going out, holding `blocks` device blocks."""
        self.blocks, self.state = blocks, "running"
        self.in_flight_tokens = tokens
        self.first_scheduled = self.first_scheduled or now
        self._view = None

    def start_swap_in(self, blocks: int, now: float) -> None:
        """Its KV comes back asynchronously into `blocks` device blocks (FastSwitch §3.2)."""
        self.swapped_blocks = 0
        self.blocks, self.state = blocks, "swapping_in"
        self.swap_started = now
        self._view = None

    def swap_in_done(self, now: float) -> None:
        """Its asynchronous swap-in finished: it joins the running batch."""
        self.state = "running"
        self.swap_stall_s += now - self.swap_started
        self._view = None

    def swapped_out(self, swapped_blocks: int) -> None:
        """Preempted by swap: its KV is on the host, its device blocks are given back."""
        self.swapped_blocks = swapped_blocks
        self.blocks, self.state = 0, "swapped"
        self._view = None

    def recompute(self) -> None:
        """Preempted by recompute: the KV is dropped (a host copy too), the tokens kept to be
        prefilled again."""
        self.blocks, self.computed_tokens, self.state = 0, 0, "waiting"
        self.swapped_blocks = 0
        self._view = None

    def resume_from_host(self, tokens: int, blocks: int) -> None:
        """A conversation's next turn starts with `tokens` of its prompt already on the host."""
        self.state, self.computed_tokens, self.swapped_blocks = "swapped", tokens, blocks
        self._view = None

    def step_done(self, stall_s: float, now: float) -> None:
        """The step it was in finished (its tokens' KV is written)."""
        self.computed_tokens += self.in_flight_tokens
        self.in_flight_tokens = 0
        self.swap_stall_s += stall_s
        self.last_scheduled_at = now
        self._view = None

    def add_token(self, token_id: int, now: float) -> None:
        self.output_ids.append(token_id)
        self.token_times.append(now)
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        self._deadline = self._due()
        self._view = None

    def stop_reason(self, token_id: int, max_context: int, limit: str = "context") -> str | None:
        """Why generation ends after `token_id` was appended, or None to go on. Reaching
        `max_context` before max_tokens (only a request admitted with `truncate`) ends with
        `limit`, the name of the smaller limit: `context` or `pool`, never `length`."""
        if token_id in self.stop_ids:
            return "stop"
        if len(self.output_ids) >= self.sampling.max_tokens:
            return "length"
        if self.context_tokens >= max_context:
            return limit
        return None

    def timeline(self, finished_at: float, reason: str) -> RequestTimeline:
        return RequestTimeline(
            request_id=self.id, request_class=self.request_class, tenant=self.tenant,
            conversation_id=self.conversation_id, prompt_tokens=len(self.prompt_ids),
            arrival=self.arrival, first_scheduled=self.first_scheduled,
            token_times=tuple(self.token_times), finished_at=finished_at, finish_reason=reason,
            preemptions=self.preemptions, swap_stall_s=self.swap_stall_s,
            ttft_slo_ms=self.ttft_ms, tpot_slo_ms=self.tpot_ms,
        )


def views_of(requests: Iterable[Request]) -> list[RequestView]:
    """Their views, in order: those kept are read without a call (a pass over every live
    request each iteration)."""
    return [r._view or r.view() for r in requests]


def held_blocks(requests: Iterable[Request], _blocks=attrgetter("blocks")) -> int:
    """Device blocks `requests` hold together (a block two of them share counts twice): a pass
    over every live request each iteration, summed in C."""
    return sum(map(_blocks, requests))


def refusal(msg: AddRequest, settings: PolicySettings, live: Iterable[Request]) -> str | None:
    """Why the policy turns a new request away, or None: an unknown class, or one with more
    than `max_queued` `live` requests not running (the new one among them)."""
    spec = settings.class_spec(msg.scheduling.request_class)
    if spec is None:
        declared = ", ".join(c.name for c in settings.classes)
        return (f"unknown request class {msg.scheduling.request_class!r} "
                f"(policy {settings.name} declares: {declared})")
    if spec.max_queued is None:
        return None
    queued = sum(1 for r in live if r.request_class == spec.name and r.state != "running")
    if queued > spec.max_queued:
        return (f"class {spec.name} already has {spec.max_queued} queued "
                f"requests (max_queued in policy {settings.name})")
    return None
