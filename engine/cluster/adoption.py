"""KunServe groups at one engine (§4.1-4.4): what the scheduler does with a `Regroup`.

A member joining a group hands every live request over (`export`): they leave its tables (their
blocks go back) and travel, state and all, to the group's head. The head takes them (`adopt`):
a request with KV (computed tokens) is `swapping_in` until the KV exchange tells it, by
`SwapDone`, that its chunks have all arrived; meanwhile the blocks it will need are counted as
held, so nothing the policy admits can take them. It then runs on from where it was (a decode
at position `computed_tokens`: never recomputed). The head's own requests whose KV for the
layers it dropped must move wait the same way (`exchange`). The pool's new size and the runner's
group mode go to the allocator and executor with the next step (`RunStep.pool_blocks`,
`RunStep.group`). Nothing here runs while a step is in flight: a `Regroup` that arrives then
is applied when the step comes back.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import attrs

from engine.messages import Regroup, RunStep
from engine.planner import blocks_for
from engine.reply import Reply
from engine.request import Request


@attrs.define
class GroupSeat:
    """The scheduler's pending group changes."""

    pending: list[Regroup] = attrs.field(factory=list)
    pool_blocks: int | None = None
    group: object | None = None
    exported: int = 0
    adopted: int = 0
    stages: int = 1
    """Pipeline stages of the group this engine heads (1: alone). A group's step keeps one
    microbatch per stage in flight, each with an instance's token budget (as vLLM's pipeline
    parallelism, which KunServe builds on, §5, gives each virtual engine): the step's token
    budget is `stages` times an instance's, so a stage prefills as fast as an instance alone.
    Its sequence budget stays one instance's: with `stages` times the sequences a group admitted
    more long prompts than its pool carries to their end (KV is reserved chunk by chunk, so
    older prefills took the blocks back by recompute, mostly mid-prefill) and every step decoded
    twice the sequences (sharegpt cluster bench: 207 recomputes, P50 TPOT 23 -> 46 ms;
    tests/sim/test_kunserve_budget.py). On the azure traces the cap never binds."""


class AdoptionMixin:
    """Mixed into the scheduler actor; reads and changes its `_live`, `_release`,
    `_total_blocks`, `_in_flight` and `_seat`."""

    _live: dict[int, Request]
    _release: list[int]
    _total_blocks: int
    _in_flight: dict[int, Request]
    _seat: GroupSeat
    _config: object
    """The reply carries what moved: a member's exported requests; at the head, the requests
    now waiting for their KV (adopted ones with KV, and its own listed in `exchange`)."""

    def _regroup(self, msg: Regroup) -> None:
        """At a step boundary; a queued-request move (`queue_only`) at once, as a new request
        or the cancel of a queued one is, unless an earlier regroup still waits for the step
        (messages apply in the order sent)."""
        if self._in_flight and (self._seat.pending or not queue_only(msg)):
            self._seat.pending.append(msg)
        else:
            self._apply_regroup(msg)

    def _regroups_after_step(self) -> None:
        pending, self._seat.pending = self._seat.pending, []
        for msg in pending:
            self._apply_regroup(msg)

    def _apply_regroup(self, msg: Regroup) -> None:
        now, seat = anyio.current_time(), self._seat
        if msg.pool_blocks is not None and msg.pool_blocks < self._total_blocks:
            # (with `recompute` every device block is given back first, and with `export` every
            # request leaves: a group's head joining a larger group as a member)
            used = 0 if msg.recompute or msg.export else sum(r.blocks for r in self._live.values())
            if used > msg.pool_blocks:  # a restore that does not fit yet: the caller retries
                msg.reply.fail(PoolTooSmall(f"{used} blocks are held, the pool would have "
                                            f"{msg.pool_blocks}"))
                return
        out: list[Request] = []
        if msg.recompute:
            for req in self._live.values():
                if req.state in ("running", "swapping_in") or (
                        req.state == "waiting" and req.computed_tokens):
                    if req.known_to_executor or req.blocks:
                        self._release.append(req.id)
                    req.known_to_executor, req.in_flight_tokens = False, 0
                    req.recompute()
                    req.preemptions += 1
                    out.append(req)
        if msg.export or msg.export_queued:
            for req in list(self._live.values()):
                if not msg.export and (req.state != "waiting" or req.computed_tokens
                                       or req.id in self._in_flight):
                    continue
                del self._live[req.id]
                if req.known_to_executor or req.blocks:
                    self._release.append(req.id)
                req.known_to_executor = False
                out.append(req)
            seat.exported += len(out)
        bs = self._config.block_size  # type: ignore[attr-defined]
        for req in msg.adopt:
            assert isinstance(req, Request)
            self._live[req.id] = req
            if msg.adopt_recompute:
                recompute_adopted(req)
            adopt(req, bs, now)
            if req.state == "swapping_in":
                out.append(req)
        seat.adopted += len(msg.adopt)
        for rid in msg.exchange:
            req = self._live.get(rid)
            if req is not None and req.state == "running" and req.computed_tokens:
                req.state, req.swap_started = "swapping_in", now
                out.append(req)
        if msg.pool_blocks is not None:
            self._total_blocks = seat.pool_blocks = msg.pool_blocks
            stats = getattr(self, "_stats", None)
            if stats is not None:
                stats.total_blocks = msg.pool_blocks
        if msg.group is not None:
            seat.group = msg.group
            seat.stages = getattr(msg.group, "size", 1)
        for req in self._live.values():  # fields set above: their views are rebuilt
            req.changed()
        msg.reply.send(tuple(out))


    def _lost_kv(self, pool_blocks: int | None) -> None:
        """The runner lost its group (a member went away) and every request's KV with it, and
        serves alone again (`StepFailed.kv_lost`, the torch runner): as `Regroup(recompute)`,
        with the runner's own pool."""
        self._apply_regroup(Regroup(recompute=True, pool_blocks=pool_blocks, reply=Reply()))

    def _with_regroup(self, step: RunStep) -> RunStep:
        """The next step carries the pool's new size and the runner's new mode, once."""
        seat = self._seat
        if seat.pool_blocks is None and seat.group is None:
            return step
        step = attrs.evolve(step, pool_blocks=seat.pool_blocks, group=seat.group)
        seat.pool_blocks = seat.group = None
        return step


def queue_only(msg: Regroup) -> bool:
    """A move of queued requests alone (§4.1's rescheduling of queued requests): hand over the
    ones waiting with no KV, or take requests that arrive with none. Neither touches a step in
    flight (no blocks, nothing the executor knows of that it still runs), so it need not wait
    for one: a move that waited for a step boundary at both ends held KunServe's monitor up
    0.4-1.24 s at a time in bursts (issue 16, round 4)."""
    if msg.export or msg.recompute or msg.exchange or msg.pool_blocks is not None \
            or msg.group is not None:
        return False
    return all(isinstance(r, Request) and not r.computed_tokens and r.state != "swapped"
               for r in msg.adopt)


def adopt(req: Request, block_size: int, now: float) -> None:
    """A request arriving at the head: with KV, it waits for its exchange holding the blocks
    it will be given; without, it waits to be scheduled like any new one."""
    req.in_flight_tokens, req.known_to_executor = 0, False
    if req.computed_tokens and req.state != "swapped":
        req.state, req.swap_started = "swapping_in", now
        req.blocks = blocks_for(req.computed_tokens, block_size)
    elif req.state != "swapped":
        req.state, req.blocks, req.computed_tokens = "waiting", 0, 0


def recompute_adopted(req: Request) -> None:
    """A request handed over for a group that was not formed: its KV (device or host copy)
    stayed with its member, so one that had any is prefilled again from its whole context."""
    if req.computed_tokens or req.state != "waiting":
        req.recompute()
        req.preemptions += 1


def exchange_bytes(requests: Sequence[Request], *, token_bytes: int, moved_share: float) -> int:
    """Bytes of KV a group's exchange moves for `requests` (each token's KV of every layer is
    `token_bytes`; `moved_share` of the layers live elsewhere after the drop)."""
    return int(sum(r.computed_tokens for r in requests) * token_bytes * moved_share)


class PoolTooSmall(Exception):
    """A shrink asked for while the requests hold more blocks than the smaller pool has."""
