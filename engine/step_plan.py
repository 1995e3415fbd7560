"""A step's life, as the scheduler's requests see it:

- `build_run_step`: an iteration's plan (engine/planner.py) becomes the one `RunStep` message the
  scheduler sends the allocator; a pure function, it changes neither the plan nor the requests;
- `start_step`: then the requests move as the plan says (running, swapping in, in flight);
- `finish_step`: the executor's `StepFinished` lands on the requests in flight: their KV, their
  new tokens, why they end, what the policy is told;
- `land_swaps`: the swap pool's `SwapDone` lands on the requests it swapped in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from engine.bidirectional_step import BidirectionalMemory
from engine.memory.host_copies import HostCopies
from engine.messages import RequestSetup, RunStep, SeqWork, StepFinished, SwapDone, SwapIn, SwapOut
from engine.planner import IterationPlan
from engine.policy import RequestView, SwapGranularity
from engine.request import Request


def build_run_step(plan: IterationPlan, *, step_id: int, requests: Mapping[int, Request],
                   swap_in_blocks: Mapping[int, tuple[int, ...]], release: Sequence[int],
                   swap_out: Sequence[SwapOut], granularity: SwapGranularity,
                   bidirectional: BidirectionalMemory | None = None) -> RunStep:
    """`requests`: live requests by id, as they were when `plan` was made; `swap_in_blocks`:
    for each request in `plan.swapped_in`, the host blocks its KV comes back from. With BROS's
    bidirectional blocks the plan is first fitted to them (engine/bidirectional_step.py: the
    one change made to `plan` here) and the step carries its tables and slot copies."""
    if bidirectional is not None:
        orders = bidirectional.fit(plan, requests, release)
        return RunStep(step_id=step_id, release=tuple(release), preempt=(), block_targets=(),
                       setups=_setups(plan, requests), seqs=_seqs(plan, requests),
                       granularity="slots", bidirectional=orders)
    swap_in = tuple(SwapIn(request_id=v.id, cpu_blocks=swap_in_blocks[v.id],
                           sync=v.id in plan.work) for v in plan.swapped_in)
    return RunStep(
        step_id=step_id, release=tuple(release), preempt=tuple(v.id for v in plan.preempted),
        block_targets=tuple(plan.block_targets.items()), setups=_setups(plan, requests),
        seqs=_seqs(plan, requests), swap_out=tuple(swap_out), swap_in=swap_in,
        granularity=granularity)


def _setups(plan: IterationPlan, requests: Mapping[int, Request]) -> tuple[RequestSetup, ...]:
    """A setup for each request in the step the executor has not seen yet, swap-ins first. Its
    tokens are the request's whole context: a request set up again after it produced tokens
    (KunServe: moved from another instance, or released to be recomputed when its group lost a
    member; engine/cluster/adoption.py) is prefilled from its output too, and the executor keeps
    no copy of it meanwhile."""
    ids = dict.fromkeys([*(v.id for v in plan.swapped_in), *plan.work])
    return tuple(
        RequestSetup(request_id=rid, prompt_ids=(*r.prompt_ids, *r.output_ids)
                     if r.output_ids else r.prompt_ids, sampling=r.sampling,
                     eos_token_ids=r.eos_token_ids)
        for rid in ids if not (r := requests[rid]).known_to_executor)


def _seqs(plan: IterationPlan, requests: Mapping[int, Request]) -> tuple[SeqWork, ...]:
    """Each request's tokens this step, in scheduling order; it samples once it has caught up
    with its whole context."""
    new, seqs = tuple.__new__, []  # SeqWork's fields in order, skipping its Python-level __new__
    for rid, n in plan.work.items():
        r = requests[rid]
        start = r.computed_tokens
        seqs.append(new(SeqWork, (rid, start, n, start + n == r.context_tokens)))
    return tuple(seqs)


def start_step(plan: IterationPlan, step: RunStep, requests: Mapping[int, Request],
               now: float) -> dict[int, Request]:
    """Apply the plan `step` was built from to the requests; returns those in flight."""
    for s in step.setups:
        requests[s.request_id].known_to_executor = True
    for v in plan.swapped_in:
        requests[v.id].swapped_blocks = 0
        if v.id not in plan.work:
            requests[v.id].start_swap_in(plan.block_targets[v.id], now)
    in_flight = {}
    for rid, n in plan.work.items():
        req = in_flight[rid] = requests[rid]
        req.schedule(n, plan.block_targets[rid], now)
    return in_flight


@attrs.frozen(kw_only=True)
class StepResult:
    served: list[tuple[RequestView, int, int]]
    """(request as the policy saw it when it planned the step, prompt tokens computed, output
    tokens produced), for the policy."""
    deadline_misses: int
    """Tokens delivered after their deadline."""
    events: list[tuple[Request, int | None, str | None]]
    """(request, its new token or None, why it ends or None), in the step's order, for each
    request that got a token or ends (aborted while in flight)."""


def finish_step(msg: StepFinished, in_flight: Mapping[int, Request],
                views: Mapping[int, RequestView], now: float, *, max_context: int,
                limit: str = "context") -> StepResult:
    """Land a finished step on the requests that were in it; `views` by id are those the
    policy was given when it planned the step (`IterationPlan.views`: what `served` reports)."""
    sampled = {s.request_id: s.token_id for s in msg.sampled}
    served: list[tuple[RequestView, int, int]] = []
    events: list[tuple[Request, int | None, str | None]] = []
    misses = 0
    for rid, req in in_flight.items():
        n = req.in_flight_tokens
        req.step_done(msg.stall_s, now)
        token = sampled.get(rid)
        if req.abort_reason is not None:
            events.append((req, None, req.abort_reason))
        elif token is None:
            served.append((views[rid], n, 0))
        else:
            misses += now > req.next_deadline()
            req.add_token(token, now)
            served.append((views[rid], n - 1, 1))
            events.append((req, token, req.stop_reason(token, max_context, limit)))
    return StepResult(served=served, deadline_misses=misses, events=events)


def land_swaps(msg: SwapDone, requests: Mapping[int, Request], copies: HostCopies | None,
               now: float) -> list[Request]:
    """Asynchronous swap-ins that finished go back to the running batch; returns the requests
    whose KV could not be copied back, to end with an error. A running request's failed swap-in
    fails the step that waited for it instead."""
    for rid in msg.request_ids:
        req = requests.get(rid)
        if req is not None and req.state == "swapping_in":
            req.swap_in_done(now)
    failed = []
    for rid in msg.failed:
        req = requests.get(rid)
        if req is None and copies is not None:
            copies.drop_conversation_copies()  # an ended turn's kept KV: which copy is unknown
        elif req is not None and req.state in ("swapped", "swapping_in"):
            failed.append(req)
    return failed
