"""The REPL's background workload: Poisson arrivals of a mix of real-time (`rt`, with TTFT and
TPOT deadlines) and best-effort (`be`) requests, a few tenants and conversations, so that a
policy change shows up in the numbers while the user watches."""

from __future__ import annotations

import random
from collections import deque

import anyio
import attrs

from engine.errors import ShunterError
from engine.params import SamplingParams, SchedulingParams
from engine.timeline import RequestTimeline
from shunter.engine import Engine

RT_SLO_MS = (400.0, 200.0)
"""TTFT and TPOT deadlines of RT requests when the policy declares no `rt` class (BROS §7.1)."""
TENANTS = ("alice", "bob", "carol")


@attrs.frozen(kw_only=True)
class Finished:
    label: str
    """`rt` or `be`: what the workload meant, whatever classes the policy declares."""
    epoch: int
    """Which policy was running when it finished (the session counts policy changes)."""
    timeline: RequestTimeline


class Workload:
    def __init__(self, engine: Engine, *, rate: float, seed: int = 0, rt_share: float = 0.5,
                 max_in_flight: int = 32, be_backlog: int = 0, keep: int = 5000) -> None:
        self.engine = engine
        self.rate = rate
        """Mean arrivals per second."""
        self.paused = False
        self.epoch = 0
        self.rt_share = rt_share
        self.max_in_flight = max_in_flight
        self.be_backlog = be_backlog
        """BE requests kept in flight on top of the arrivals (a closed loop), so that a queue
        forms however fast the machine is and the policy's order shows in the numbers."""
        self.in_flight = {"rt": 0, "be": 0}
        self.finished: deque[Finished] = deque(maxlen=keep)
        self.submitted = 0
        self.failed = 0
        self.last_error = ""
        self._rng = random.Random(seed)

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._keep_backlog, tg)
            while True:
                if self.paused or self.rate <= 0:
                    await anyio.sleep(0.05)
                    continue
                await anyio.sleep(self._rng.expovariate(self.rate))
                if self.paused or sum(self.in_flight.values()) >= self.max_in_flight + \
                        self.be_backlog:
                    continue
                label = "rt" if self._rng.random() < self.rt_share else "be"
                tg.start_soon(self._one, label, self._request(label))

    async def _keep_backlog(self, tg: anyio.abc.TaskGroup) -> None:
        while True:
            while not self.paused and self.in_flight["be"] < self.be_backlog:
                self.in_flight["be"] += 1  # counted now: `_one` starts later
                tg.start_soon(self._one, "be", self._request("be"), True)
            await anyio.sleep(0.02)

    def _request(self, label: str) -> tuple[list[int], SamplingParams, SchedulingParams]:
        rng, backend = self._rng, self.engine.backend
        self.submitted += 1
        lo, hi, out = ((4, 32, (8, 24)) if label == "rt" else (48, 128, (16, 40)))
        vocab = backend.vocab_size
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))]
        params = SamplingParams(max_tokens=rng.randint(*out), ignore_eos=True)
        declared = self.engine.policy.settings.class_spec(label)
        ttft, tpot = RT_SLO_MS if label == "rt" and declared is None else (None, None)
        scheduling = SchedulingParams(
            priority=rng.randint(0, 2), request_class=label if declared else None,
            tenant=rng.choice(TENANTS), ttft_ms=ttft, tpot_ms=tpot,
            conversation_id=f"chat-{rng.randrange(8)}" if label == "rt" else None)
        return prompt, params, scheduling

    def _class_withdrawn(self, scheduling: SchedulingParams, exc: ShunterError) -> bool:
        wanted = scheduling.request_class
        return (wanted is not None and "unknown request class" in str(exc)
                and self.engine.policy.settings.class_spec(wanted) is None)

    async def _one(self, label: str, request: tuple, counted: bool = False) -> None:
        prompt, params, scheduling = request
        if not counted:
            self.in_flight[label] += 1
        try:
            try:
                done = await self.engine.complete(prompt, params, scheduling=scheduling)
            except ShunterError as exc:
                if not self._class_withdrawn(scheduling, exc):
                    raise
                # the policy was switched while the request travelled, to one without its
                # class: send it again as the running policy's default class
                rt = label == "rt"
                scheduling = attrs.evolve(scheduling, request_class=None,
                                          ttft_ms=RT_SLO_MS[0] if rt else None,
                                          tpot_ms=RT_SLO_MS[1] if rt else None)
                done = await self.engine.complete(prompt, params, scheduling=scheduling)
        except ShunterError as exc:
            self.failed += 1
            self.last_error = str(exc)
        else:
            if done.timeline is not None:
                self.finished.append(Finished(label=label, epoch=self.epoch, timeline=done.timeline))
        finally:
            self.in_flight[label] -= 1
