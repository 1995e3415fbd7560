"""The client side of a benchmark: submit a workload's requests to a running engine at their
arrival times (later turns after their parent's answer, BE batches in a closed loop) and collect
every request's timeline. Runs inside the engine's event loop; reads time only from
`anyio.current_time()`, so under a MockClock it replays in virtual time."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import attrs

from engine.errors import ShunterError
from engine.metrics import Goal
from engine.params import SamplingParams, SchedulingParams
from engine.timeline import RequestTimeline
from shunter.client import Completion
from shunter.workloads import BatchSource, RequestSpec, Workload
from shunter.workloads.tokens import TokenIds


@attrs.define(eq=False)
class DriveResult:
    timelines: list[RequestTimeline] = attrs.field(factory=list)
    goals: dict[int, Goal] = attrs.field(factory=dict)
    """Engine request id -> the class label and SLOs the workload gave it."""
    failed: list[Goal] = attrs.field(factory=list)
    """Requests refused at admission or failed (no timeline to judge)."""
    errors: dict[str, int] = attrs.field(factory=dict)
    """Distinct failure messages and how often each happened."""
    started: float = 0.0
    finished: float = 0.0
    """Engine clock at the first arrival and at the last answer."""
    cluster: dict | None = None
    """KunServe's counters of a cluster run (shunter/cluster/groups.py `report`)."""


class _Links:
    """What later requests need of earlier ones: their prompt (shared prefixes) and their
    whole context once answered (later turns). Kept only for requests that have children."""

    def __init__(self, specs: Sequence[RequestSpec]) -> None:
        self.children: dict[int, int] = {}
        for s in specs:
            if s.parent is not None:
                self.children[s.parent] = self.children.get(s.parent, 0) + 1
        self.sent = {i: anyio.Event() for i in self.children}
        self.done = {i: anyio.Event() for i in self.children}
        self.prompt: dict[int, Sequence[int]] = {}
        self.context: dict[int, Sequence[int]] = {}

    async def parent_context(self, spec: RequestSpec) -> Sequence[int] | None:
        p = spec.parent
        if p is None:
            return None
        if spec.needs_parent_output:
            await self.done[p].wait()
            if spec.after_parent_s:
                await anyio.sleep(spec.after_parent_s)
            ctx = self.context[p]
        else:
            await self.sent[p].wait()
            ctx = self.prompt[p]
        self.children[p] -= 1
        if self.children[p] == 0:  # the last child has it: forget it
            self.prompt.pop(p, None)
            self.context.pop(p, None)
        return ctx

    def on_sent(self, index: int, prompt: Sequence[int]) -> None:
        if index in self.sent:
            self.prompt[index] = prompt
            self.sent[index].set()

    def on_done(self, index: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        if index in self.done:
            self.context[index] = TokenIds([prompt, tuple(output)])
            self.done[index].set()


class Completer(Protocol):
    """What the driver sends requests to: `shunter.Engine` in-process, or `shunter.Client` over
    HTTP (whose timelines are taken on the client's clock)."""

    async def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       scheduling: SchedulingParams | None = None) -> Completion: ...


class Driver:
    def __init__(self, engine: Completer, workload: Workload, *, vocab: int,
                 declared_classes: set[str], on_progress: Callable[[int, int], None] | None = None) -> None:
        self.engine = engine
        self.workload = workload
        self.vocab = vocab
        self.declared = declared_classes
        self.on_progress = on_progress or (lambda done, failed: None)
        self.result = DriveResult()
        self.links = _Links(workload.requests)
        self.t0 = 0.0
        self.ended = 0

    async def run(self) -> DriveResult:
        self.t0 = self.result.started = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for src in self.workload.batches:
                tg.start_soon(self._batches, src)
            for spec in sorted(self.workload.requests, key=lambda s: s.arrival_s):
                await anyio.sleep_until(self.t0 + spec.arrival_s)
                tg.start_soon(self._one, spec)
        return self.result

    async def _batches(self, src: BatchSource) -> None:
        await anyio.sleep_until(self.t0 + src.start_s)
        k = 0
        while src.max_batches is None or k < src.max_batches:
            if src.stop_s is not None and anyio.current_time() - self.t0 >= src.stop_s:
                return
            async with anyio.create_task_group() as tg:
                for spec in src.batch(k, self.workload.length_scale):
                    tg.start_soon(self._one, spec)
            k += 1

    async def _one(self, spec: RequestSpec) -> None:
        ctx = await self.links.parent_context(spec)
        prompt = self.workload.prompt(spec, self.vocab, ctx)
        self.links.on_sent(spec.index, prompt)
        goal = Goal(request_class=spec.request_class, ttft_ms=spec.ttft_ms, tpot_ms=spec.tpot_ms)
        sched = SchedulingParams(
            priority=spec.priority, tenant=spec.tenant, conversation_id=spec.conversation_id,
            request_class=spec.request_class if spec.request_class in self.declared else None,
            ttft_ms=spec.ttft_ms, tpot_ms=spec.tpot_ms,
            trace_id=f"{self.workload.seed}/{spec.index}")
        params = SamplingParams(max_tokens=spec.output_tokens, ignore_eos=True)
        output: Sequence[int] = ()
        try:
            done = await self.engine.complete(prompt, params, scheduling=sched)
        except ShunterError as exc:
            self.result.failed.append(goal)
            msg = f"{type(exc).__name__}: {exc}"
            self.result.errors[msg] = self.result.errors.get(msg, 0) + 1
        else:
            output = done.token_ids
            if done.timeline is not None:
                self.result.timelines.append(done.timeline)
                self.result.goals[done.request_id] = goal
        finally:
            self.links.on_done(spec.index, prompt, output)
        self.result.finished = max(self.result.finished, anyio.current_time())
        self.ended += 1
        self.on_progress(len(self.result.timelines), len(self.result.failed))


def expected_requests(workload: Workload) -> int | None:
    """How many requests a run will send, when that is known in advance."""
    n = len(workload.requests)
    for src in workload.batches:
        if src.max_batches is None:
            return None
        n += src.max_batches * src.batch_size
    return n


def elapsed(result: DriveResult) -> float:
    d = result.finished - result.started
    return d if d > 0 else math.nan
