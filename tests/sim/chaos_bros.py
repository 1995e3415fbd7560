"""Chaos on BROS's memory mechanisms (issue 14): requests cancelled by their clients at awkward
moments while RT overwrites BE slots, BE slots are lazily checkpointed, displaced BE requests
swap their checkpoints back, blocks are shared by an RT and a BE owner, and §5.2's extreme case
swaps whole requests out. Used by tests/sim/test_chaos_bros_sim.py (the simulator, many seeded
schedules) and tests/shunter/test_chaos_bros_torch.py (the torch backend, outputs checked).

`Watch` wraps the engine's own objects while a run lasts:
- every fit of the bidirectional table (`BidirectionalMemory.fit`) is followed by the table
  test's invariant check (tests/engine/memory/test_bidirectional.py `SlotModel.check`, here over
  the table's own block ids: no slot with two live owners, a checkpoint covers exactly the
  overwritten slots, counts and the preemption order), run on a model of the device and host
  slots that each step's copies are applied to, in order, and then the step's own writes:
  every live slot and every checkpoint must still hold its request's KV;
- after each fit, requests in an awkward state are cancelled by their client with a seeded
  probability: those whose checkpoints or whole KV come back in that very step (the copies in
  flight), displaced ones, swapped-out ones (BE and RT), owners of a shared block, RT
  requests that just overwrote BE slots;
- the scheduler's admissions and endings are recorded, so that every admitted request is seen
  to end exactly once and with the reason its client saw.
`leftovers` lists what is not back once the engine is idle: table, host slots, copy space,
the table's own indexes, the fit's sent tables and pending copies, the swap pool's tickets.
On the simulator `Watch.fail_transfers` makes the copier's transfers of those numbers fail
(`SimSwapper.fail_transfers`), and the slots such a transfer was to write hold no one's KV in
the model from then on (tests/sim/test_chaos_bros_faults_sim.py).
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Callable, Iterator

import anyio
import attrs

from actors.scheduler import Scheduler
from actors.swap_pool import SwapPool
from engine.bidirectional_step import BidirectionalMemory
from engine.memory.slot_runs import decode, physical_slot
from shunter import SamplingParams, SchedulingParams
from sim.swap import SimSwapper
from tests.engine.memory.test_bidirectional import SlotModel

LOST = ("lost",)
"""What a slot holds in the model once a failed copy was to write it."""

AWKWARD = ("swap_back", "displaced", "swapped_be", "swapped_rt", "shared", "overwriting")
"""The states `Watch` cancels requests in (counted in `Watch.hits`)."""


class _Slots(dict):
    def __missing__(self, slot: int) -> None:  # a slot never written holds no one's KV
        return None


class TagModel(SlotModel):
    """SlotModel over a whole engine step: the step's copies in order, each batch a gather (all
    its reads before its writes), then every request of the step writes its new positions."""

    def __init__(self, t) -> None:
        super().__init__(t)
        self.device, self.host = _Slots(), _Slots()

    def check(self) -> None:
        """SlotModel.check's invariants, over the table's own block ids (the torch backend's
        start past the weights in the arena; SlotModel's from 0)."""
        t, seen, bs = self.t, {}, self.t.block_size
        for rid in t.requests():
            host = t.host_slots(rid)
            for pos, slot in t.live_slots(rid):
                assert slot not in seen, f"slot {slot} held by {seen.get(slot)} and {rid}"
                seen[slot] = rid
                assert self.device[slot] == (rid, pos), "a live slot lost its KV"
            for pos, h in host.items():
                assert self.host[h] == (rid, pos), "a checkpoint does not hold its KV"
            assert len(host) == (t.tokens(rid) if t.swapped(rid) else
                                 t.tokens(rid) - sum(1 for _ in t.live_slots(rid)))
            assert len(t.table(rid)) == (0 if t.swapped(rid) else -(-t.tokens(rid) // bs))
        held = [h for rid in t.requests() for h in t.host_slots(rid).values()]
        assert len(held) == len(set(held)), "a host slot with two owners"
        for b in t._ids:  # a checkpoint covers exactly the overwritten slots of each block
            _, _, be, _, lost = t.block(b)
            if be >= 0:
                table = t.table(be)
                j = next(j for j, e in enumerate(table) if decode(e)[0] == b)
                assert {bs - 1 - (p - j * bs) for p in t.host_slots(be) if p // bs == j} == lost
            else:
                assert not lost, f"block {b} has overwritten slots and no BE owner"
        owned = {decode(e)[0] for rid in t.requests() for e in t.table(rid)}
        assert t.num_free == t.num_total - len(owned), "the free count is off"
        be_only = [b for b in t._ids if t.block(b)[0] < 0 and t.block(b)[2] >= 0]
        assert t.rt_room() == t.num_free + len(be_only), "the RT room is off"
        assert set(t._be) == {rid for rid in t.requests() if t.is_reversed(rid)}
        assert t._displaced == {decode(e)[0] for rid in t.requests()
                                if t.is_reversed(rid) and t.displaced(rid) for e in t.table(rid)}
        by_key = sorted(be_only, key=t._preempt_key, reverse=True)
        assert t._preemption_order(len(be_only)) == by_key, "block preemption's order is off"

    def step(self, transfers, work: dict[int, int], computed: dict[int, int]) -> None:
        for t in transfers:
            src = self.device if t.direction in ("out", "move") else self.host
            dst = self.host if t.direction == "out" else self.device
            read = [(d, src[s]) for s, d in t.pairs]
            for d, tag in read:
                dst[d] = tag
        bs = self.t.block_size
        for rid, n in work.items():
            table = self.t.entries(rid)
            for pos in range(computed[rid], computed[rid] + n):
                self.device[physical_slot(table[pos // bs], pos % bs, bs)] = (rid, pos)


@attrs.define
class Watch:
    rng: random.Random
    cancel_p: float = 0.3
    """Probability of cancelling a request seen in an awkward state after a fit."""
    cancel: Callable[[int], bool] = lambda rid: False
    """Cancels request `rid` as its client would; False if the client does not know it yet."""
    memories: list[BidirectionalMemory] = attrs.field(factory=list)
    pools: list[SwapPool] = attrs.field(factory=list)
    schedulers: list[Scheduler] = attrs.field(factory=list)
    models: dict[int, TagModel] = attrs.field(factory=dict)
    admitted: list[int] = attrs.field(factory=list)
    ended: dict[int, list[tuple[str, str | None]]] = attrs.field(factory=dict)
    hits: Counter = attrs.field(factory=Counter)
    """Requests cancelled per awkward state."""
    seen: Counter = attrs.field(factory=Counter)
    """Fits in which some request was in each awkward state."""
    fits: int = 0
    broken: list[str] = attrs.field(factory=list)
    """The first invariant check that failed after a fit (at most one)."""
    aborted_live: set[int] = attrs.field(factory=set)
    """Requests whose cancel reached the scheduler while they were live: they end cancelled."""
    idle: bool = True
    """The engine went idle once the clients were done (False: something never ended)."""
    errors: list[str] = attrs.field(factory=list)
    """Clients' errors (`client_errors`)."""
    client: dict[int, str | None] = attrs.field(factory=dict)
    """Request id -> the finish reason its client read (None: it cancelled first)."""
    fail_transfers: frozenset[int] = frozenset()
    """The simulator's copier fails these transfers (counted from 1)."""
    failed_copies: int = 0
    """Transfers that failed."""

    def copy_failed(self, direction: str, pairs) -> None:
        """A transfer failed: the slots it was to write hold no one's KV (the fit's model
        applied its copies already; the run's one table, so its one model)."""
        self.failed_copies += 1
        for model in self.models.values():
            dst = model.host if direction == "out" else model.device
            for _, d in pairs:
                dst[d] = LOST

    def after_fit(self, mem: BidirectionalMemory, plan, requests, orders) -> None:
        t = mem.table
        model = self.models.setdefault(id(mem), TagModel(t))
        computed = {rid: requests[rid].computed_tokens for rid in plan.work}
        self.fits += 1
        if self.broken:  # the model has diverged from the table: checked no further
            return
        model.step(orders.transfers, dict(plan.work), computed)
        try:
            model.check()
        except AssertionError as exc:  # not raised inside the scheduler: it would stop it
            self.broken.append(f"fit {self.fits}: {type(exc).__name__}: {exc}".splitlines()[0])
        states: dict[str, set[int]] = {k: set() for k in AWKWARD}
        states["swap_back"] = {x.request_id for x in orders.transfers if x.direction == "in"}
        for rid in t.requests():
            if t.swapped(rid):  # §5.2's extreme case drops BE first, then RT
                states["swapped_be" if t.is_reversed(rid) else "swapped_rt"].add(rid)
            elif t.displaced(rid):
                states["displaced"].add(rid)
        for b in t._ids:
            rt, rt_fill, be, _, lost = t.block(b)
            if rt >= 0 and be >= 0:
                states["shared"] |= {rt, be}
                if lost:
                    states["overwriting"].add(rt)
        for state in AWKWARD:
            self.seen[state] += bool(states[state])
            for rid in sorted(states[state]):
                if self.rng.random() < self.cancel_p and self.cancel(rid):
                    self.hits[state] += 1

    def leftovers(self) -> list[str]:
        """What is not back once the engine is idle (empty when nothing leaked)."""
        out = list(self.broken)
        if not self.idle:
            out.append("the engine never went idle")
        for mem in self.memories:
            t = mem.table
            if t.requests():
                out.append(f"table still holds requests {sorted(t.requests())}")
            if t.num_free != t.num_total:
                out.append(f"{t.num_total - t.num_free} device blocks not free")
            if t.free_host_slots != len(t._free_host._free):
                out.append(f"{len(t._free_host._free) - t.free_host_slots} host slots not free")
            if t._free_host._free.count(0):
                out.append(f"host slots marked taken: {t._free_host._free.count(0)}")
            if t.has_copy_space and t._copy_space.num_free != t._copy_space.num_total:
                out.append(f"{t._copy_space.num_total - t._copy_space.num_free} copy-space "
                           f"blocks not free")
            busy = [b for b in t._ids if t.block(b) != (-1, 0, -1, 0, frozenset())]
            if busy:
                out.append(f"blocks with an owner, fill or overwritten slot: {busy}")
            for name in ("_be", "_be_only", "_holed", "_displaced"):
                if getattr(t, name):
                    out.append(f"table.{name} not empty: {getattr(t, name)}")
            if mem._sent:
                out.append(f"tables still sent for {sorted(mem._sent)}")
            if mem._pending:
                out.append(f"pending copies of {[rid for rid, _ in mem._pending]}")
        for pool in self.pools:
            if pool._pending:
                out.append(f"swap pool tickets pending: {sorted(pool._pending)}")
        for s in self.schedulers:
            if s._live or s._release or s._in_flight:
                out.append(f"scheduler: live {sorted(s._live)}, release {s._release}, "
                           f"in flight {sorted(s._in_flight)}")
        return out

    def endings(self, client: dict[int, str | None]) -> list[str]:
        """Requests that did not end exactly once with the reason their client saw; `client`:
        request id -> the finish reason its client read, None if it cancelled first."""
        out = []
        for rid in self.admitted:
            ends = self.ended.get(rid, [])
            if len(ends) != 1:
                out.append(f"request {rid} ended {len(ends)} times: {ends}")
                continue
            reason, error = ends[0]
            if reason == "error":
                out.append(f"request {rid} failed: {error}")
            elif rid in self.aborted_live and reason != "cancelled":
                out.append(f"request {rid} was cancelled while live but ended {reason}")
            elif rid in client and client[rid] is not None and client[rid] != reason:
                out.append(f"request {rid}: the client read {client[rid]}, it ended {reason}")
            elif rid not in self.aborted_live and reason not in ("stop", "length"):
                out.append(f"request {rid} was not cancelled while live but ended {reason}")
        return out


@contextlib.contextmanager
def watching(watch: Watch) -> Iterator[Watch]:
    """Wrap the engine's classes for `watch` while the block runs."""
    fit, mem_init = BidirectionalMemory.fit, BidirectionalMemory.__init__
    pool_init, sched_init = SwapPool.__init__, Scheduler.__init__
    add, finish, abort = Scheduler._add, Scheduler._finish, Scheduler._abort
    swapper_init, submit = SimSwapper.__init__, SimSwapper.submit

    def swapper_made(self, *a, **k):
        swapper_init(self, *a, **k)
        self.fail_transfers = watch.fail_transfers

    def submitted(self, ticket_id, direction, pairs, granularity):
        submit(self, ticket_id, direction, pairs, granularity)
        if self.transfers in self.fail_transfers:
            watch.copy_failed(direction, pairs)

    def fit_watched(self, plan, requests, release):
        orders = fit(self, plan, requests, release)
        watch.after_fit(self, plan, requests, orders)
        return orders

    def mem_made(self, *a, **k):
        mem_init(self, *a, **k)
        watch.memories.append(self)

    def pool_made(self, *a, **k):
        pool_init(self, *a, **k)
        watch.pools.append(self)

    def sched_made(self, *a, **k):
        sched_init(self, *a, **k)
        watch.schedulers.append(self)

    def added(self, msg):
        watch.admitted.append(msg.request_id)
        add(self, msg)

    def aborted(self, rid, reason):
        if rid in self._live and reason == "cancelled":
            watch.aborted_live.add(rid)
        abort(self, rid, reason)

    def finished(self, req, reason, error=None):
        watch.ended.setdefault(req.id, []).append((reason, error))
        finish(self, req, reason, error)

    BidirectionalMemory.fit, BidirectionalMemory.__init__ = fit_watched, mem_made
    SwapPool.__init__, Scheduler.__init__ = pool_made, sched_made
    Scheduler._add, Scheduler._finish, Scheduler._abort = added, finished, aborted
    SimSwapper.__init__, SimSwapper.submit = swapper_made, submitted
    try:
        yield watch
    finally:
        BidirectionalMemory.fit, BidirectionalMemory.__init__ = fit, mem_init
        SwapPool.__init__, Scheduler.__init__ = pool_init, sched_init
        Scheduler._add, Scheduler._finish, Scheduler._abort = add, finish, abort
        SimSwapper.__init__, SimSwapper.submit = swapper_init, submit


@attrs.define
class Client:
    """One request as its client sends it, and how the client ends it early (or not)."""
    label: str
    prompt: list[int]
    request_class: str | None
    """None: the policy's default class."""
    max_tokens: int
    start_s: float
    cancel_after_s: float | None = None
    """The client gives up this long after it sent the request (a timeout, a disconnect)."""
    stop_after_tokens: int | None = None
    """The client leaves the stream after this many tokens (closing it)."""
    tokens: list[int] = attrs.field(factory=list)
    finish: str | None = None
    request_id: int | None = None
    scope: object = None
    stream: object = None

    error: str | None = None
    """What the client's stream raised (a failed request, a dead engine)."""
    left: bool = False
    """The client left before the end: it gave up, was cancelled, or closed the stream."""

    async def run(self, engine) -> None:
        try:
            await self._run(engine)
        except Exception as exc:  # noqa: BLE001 - reported by `client_errors`
            self.error = f"{type(exc).__name__}: {exc}"
        self.left = self.finish is None and self.error is None

    async def _run(self, engine) -> None:
        await anyio.sleep(self.start_s)
        with anyio.CancelScope() as self.scope:
            if self.cancel_after_s is not None:
                self.scope.deadline = anyio.current_time() + self.cancel_after_s
            async with engine.generate(
                    self.prompt, SamplingParams(max_tokens=self.max_tokens),
                    scheduling=SchedulingParams(request_class=self.request_class)
                    if self.request_class else SchedulingParams()) as stream:
                self.stream = stream
                async for chunk in stream:
                    self.request_id = chunk.request_id
                    self.tokens += chunk.token_ids
                    self.finish = chunk.finish_reason
                    if (self.finish is None and self.stop_after_tokens is not None
                            and len(self.tokens) >= self.stop_after_tokens):
                        break  # the stream closes: the request is cancelled


def canceller(clients: list[Client]) -> Callable[[int], bool]:
    """Watch.cancel over `clients`: cancels the client task reading request `rid`."""
    def cancel(rid: int) -> bool:
        for c in clients:
            stream = c.stream
            if (stream is not None and stream.request_id == rid and c.finish is None
                    and not c.left and not c.scope.cancel_called):
                c.scope.cancel()
                return True
        return False
    return cancel


async def drive(engine, clients: list[Client]) -> dict[int, str | None]:
    """Run every client; returns request id -> the finish reason its client read (None: it
    cancelled first), for the requests the engine admitted."""
    async with anyio.create_task_group() as tg:
        for c in clients:
            tg.start_soon(c.run, engine)
    return {c.stream.request_id: c.finish for c in clients
            if c.stream is not None and c.stream.request_id is not None}


def client_errors(clients: list[Client]) -> list[str]:
    return [f"{c.label}: {c.error}" for c in clients if c.error is not None]
