"""The front door's handles on instances: one interface (submit, cancel, snapshot, replace the
policy), two transports: `RemoteInstance` over a control link to an instance process (local or
Ray), `InProcessInstance` around an Engine in this process (the simulator's N instances on one
virtual clock; shunter/cluster/inprocess.py).

A handle relays each request's outputs to the client's stream under the cluster's request id.
When its instance dies (or goes silent: no answer to the heartbeat for `silent_after_s`,
shunter/cluster/heartbeat.py), a request that has streamed nothing yet is handed back to the
cluster to be dispatched again (`Redispatch`); one that has streamed tokens ends with finish
reason `error` naming the instance and why it died (its tokens cannot be taken back, and a sampled
continuation elsewhere would not be the same request). A request that an instance's stopped
engine refused before admitting it is handed back the same way, the instance marked down.
A client found gone has its request cancelled on the instance (one that left before its
`Admitted` had no id to cancel with), and at shutdown every live request's stream is ended.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Awaitable, Callable

import anyio
import attrs

from engine.cluster.dispatch import InstanceStats
from engine.errors import EngineDeadError, PolicyError
from engine.messages import Submit
from engine.outputs import Admitted, GenerationChunk, Rejected
from engine.reply import Reply
from engine.snapshots import EngineSnapshot
from shunter.cluster.group_wire import GroupAnswer
from shunter.cluster.heartbeat import Heartbeat, Liveness
from shunter.cluster.wire import (
    AskSnapshot,
    AskStats,
    CancelRequest,
    Detach,
    Link,
    Output,
    PeerLost,
    PolicyReplaced,
    Pong,
    ReplacePolicyText,
    Shutdown,
    Snapshot,
    Stats,
    SubmitRequest,
)

Redispatch = Callable[[int, Submit, bool, float], Awaitable[None]]
"""(cluster request id, the client's submission, whether the client already got `Admitted`,
when the front door first took it): serve it on another instance."""
Ended = Callable[[int], None]
"""Told once per request when its last output has been relayed (or it was handed back)."""
Down = Callable[[int, str], Awaitable[None]]
"""(instance, why): told once, before its requests are handed back or ended."""


@attrs.define(eq=False)
class _Live:
    submit: Submit
    announced: bool
    """The client already got `Admitted` (from this instance or an earlier, dead one)."""
    since: float
    """When the front door first took the request (its clock): the request's timeline counts
    from there, so a handed-back request's TTFT includes its time at the dead instance."""
    earlier_s: float
    """How long before this instance got it the front door took it (a duration, so it holds
    whatever clock the instance's timeline is in)."""
    streamed: bool = False
    """A chunk with tokens has reached the client."""


def _live(submit: Submit, announced: bool, since: float | None) -> _Live:
    now = anyio.current_time()
    return _Live(submit=submit, announced=announced, since=now if since is None else since,
                 earlier_s=0.0 if since is None else now - since)


class _Relay:
    """What both handles share: the live requests and how outputs reach their clients."""

    def __init__(self, index: int, on_end: Ended, redispatch: Redispatch, on_down: Down) -> None:
        self.index = index
        self._on_down = on_down
        self.failure: str | None = None
        self._live: dict[int, _Live] = {}
        self._on_end = on_end
        self._redispatch = redispatch

    @property
    def alive(self) -> bool:
        return self.failure is None

    @property
    def live_requests(self) -> int:
        return len(self._live)

    async def _forward(self, key: int, out) -> None:
        live = self._live.get(key)
        if live is None:
            return
        if (isinstance(out, Rejected) and isinstance(out.error, EngineDeadError)
                and not live.streamed):
            # its engine stopped (an actor failed) before the monitor's next round saw it, and
            # the request never started there: served elsewhere, as a dead process's would be
            self._finish(key)
            await self.mark_down(f"instance {self.index}: {out.error}")
            await self._redispatch(key, live.submit, live.announced, live.since)
            return
        send = live.submit.outputs
        try:
            match out:
                case Admitted():
                    if not live.announced:
                        live.announced = True
                        await send.send(Admitted(request_id=key))
                    return
                case Rejected():
                    await send.send(refusal(key, out, announced=live.announced))
                case GenerationChunk():
                    live.streamed = live.streamed or bool(out.token_ids)
                    await send.send(_from_the_front_door(out, key, live.earlier_s))
                    if out.finish_reason is None:
                        return
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            # the client went away: cancel the request here (a client that left before its
            # `Admitted`, or while its request was handed back, had no way to)
            if not _final(out):
                self.cancel_nowait(key)
        self._finish(key)

    def _end_live(self) -> None:
        """The cluster shuts down: every live request's client sees its stream end and raises
        EngineDeadError with the cluster's reason, as an Engine's clients do when it stops."""
        for key, live in list(self._live.items()):
            self._finish(key)
            live.submit.outputs.close()

    def _finish(self, key: int) -> None:
        if self._live.pop(key, None) is not None:
            self._on_end(key)

    async def mark_down(self, reason: str) -> None:
        """The instance's engine stopped while its process lives: dispatch nothing more here
        (its live requests end through the engine, each with its own error)."""
        if self.failure is None:
            self.failure = reason
            await self._on_down(self.index, reason)

    async def _instance_died(self, reason: str) -> None:
        """End or hand back every live request (see the module docstring)."""
        self.failure = reason
        await self._on_down(self.index, reason)  # so nothing is dispatched here again
        for key, live in list(self._live.items()):
            self._finish(key)
            if not live.streamed:
                await self._redispatch(key, live.submit, live.announced, live.since)
                continue
            await tell(live.submit.outputs, GenerationChunk(
                request_id=key, token_ids=(), text="", finish_reason="error",
                error=f"{reason}; the request had streamed tokens, so it was not sent to another "
                      f"instance"))


def _from_the_front_door(chunk: GenerationChunk, key: int, earlier_s: float) -> GenerationChunk:
    """An instance's chunk under the cluster's id, its timeline (on the last chunk) counted
    from when the front door took the request."""
    timeline = chunk.timeline
    if timeline is not None and earlier_s > 0:
        timeline = attrs.evolve(timeline, arrival=timeline.arrival - earlier_s)
    return attrs.evolve(chunk, request_id=key, timeline=timeline)


def _final(out) -> bool:
    return isinstance(out, Rejected) or (isinstance(out, GenerationChunk)
                                         and out.finish_reason is not None)


async def tell(outputs, out) -> None:
    """Send `out` to a client's stream; a client that went away takes nothing."""
    try:
        await outputs.send(out)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass


def refusal(key: int, rejected: Rejected, *, announced: bool) -> Rejected | GenerationChunk:
    """An instance's refusal as its client can take it: `Rejected` while the client still waits
    for its admission answer; once it got `Admitted` (from an instance that died since), a last
    chunk with the error, since its stream now carries chunks only."""
    if not announced:
        return rejected
    return GenerationChunk(request_id=key, token_ids=(), text="", finish_reason="error",
                           error=str(rejected.error))


class RemoteInstance(_Relay):
    """An instance in another process, over its control link."""

    def __init__(self, index: int, link: Link, *, on_end: Ended, redispatch: Redispatch,
                 on_down: Down, describe_death: Callable[[], str], kill: Callable[[], None],
                 pid: int | None = None, liveness: Liveness | None = None) -> None:
        super().__init__(index, on_end, redispatch, on_down)
        self._link = link
        self._describe_death = describe_death
        self.kill = kill
        """Ends the instance's process (the cluster's shutdown, and the failure tests)."""
        self.pid = pid
        self._asks: dict[int, Reply] = {}
        self._ask_ids = itertools.count()
        self._cancels_send, self._cancels = anyio.create_memory_object_stream[int](math.inf)
        self._closing = False
        self._link_lost = False
        """A question could not be sent: the link broke (the process's fate says why)."""
        self.moved_to: dict[int, RemoteInstance] = {}
        """KunServe: requests that moved to a group's head, whose cancels go there."""
        self.heartbeat = None if liveness is None else Heartbeat(index, liveness, self._ping,
                                                                  self._went_silent)
        self._reading = anyio.CancelScope()
        self._silent: str | None = None
        """Why the heartbeat declared the instance lost (its link never closed)."""

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Relay the instance's messages until its link closes."""
        task_status.started()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._send_cancels)
            if self.heartbeat is not None:
                tg.start_soon(self.heartbeat.run)
            while self._silent is None:
                self._reading = anyio.CancelScope()  # cancelled when the instance goes silent
                try:
                    with self._reading:
                        msg = await self._link.receive()
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                        anyio.ClosedResourceError, OSError):
                    break
                if self._reading.cancel_called:
                    break
                if self.heartbeat is not None:
                    self.heartbeat.heard()
                match msg:
                    case Output(key=key, output=out):
                        await self._forward(key, out)
                    case Pong(seq=seq):
                        self.heartbeat.answered(seq)
                    case (Snapshot(key=key) | Stats(key=key) | PolicyReplaced(key=key)
                          | GroupAnswer(key=key)):
                        reply = self._asks.pop(key, None)
                        if reply is not None:
                            reply.send(msg)
            if self._silent is not None:  # before waiting for its senders: a send blocked on
                await anyio.aclose_forcefully(self._link)  # a full buffer ends now
            tg.cancel_scope.cancel()
        died = not self._closing and (self.failure is None or bool(self._live)
                                      or self._silent is not None)
        if died and self._silent is not None:  # its link, never closed, was closed above
            reason = self._silent
            await anyio.to_thread.run_sync(_kill_quietly, self.kill, abandon_on_cancel=True)
        elif died and (self.failure is None or self._link_lost):  # not the engine's own reason
            reason = await anyio.to_thread.run_sync(self._describe_death)
        else:
            reason = self.failure or f"instance {self.index}: its link was closed"
        for reply in self._asks.values():  # every question still open, whatever ended the link
            reply.fail(EngineDeadError(reason))
        self._asks.clear()
        if died:
            await self._instance_died(reason)

    @property
    def went_silent(self) -> bool:
        """Declared lost by the heartbeat (its link never closed)."""
        return self._silent is not None

    async def peer_lost(self, index: int) -> None:
        """Instance `index` went silent: this one's data plane counts it gone."""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self._link.send(PeerLost(index=index))

    def _went_silent(self, reason: str) -> None:
        if not self._closing:
            self._silent = reason
            self._reading.cancel()  # the reader waits on a link that never closes

    async def _ping(self, seq: int) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self._link.send(self.heartbeat.ping_message(seq))

    async def _send_cancels(self) -> None:
        async for key in self._cancels:
            try:
                await self._link.send(CancelRequest(key=key))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return

    async def submit(self, key: int, submit: Submit, *, announced: bool = False,
                     since: float | None = None) -> None:
        live = _live(submit, announced, since)
        if self.failure is not None:  # chosen just before the coordinator heard of the death
            self._on_end(key)  # what the coordinator counted in flight here
            await self._redispatch(key, submit, announced, live.since)
            return
        self._live[key] = live
        ids = None if submit.prompt_ids is None else tuple(submit.prompt_ids)
        try:
            await self._link.send(SubmitRequest(
                key=key, prompt=submit.prompt, prompt_ids=ids, sampling=submit.sampling,
                scheduling=submit.scheduling, stream=submit.stream))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the reader sees the link close and hands the request back

    def cancel_nowait(self, key: int) -> None:
        if key in self.moved_to:
            self.moved_to[key].cancel_nowait(key)
        elif key in self._live:
            self._cancels_send.send_nowait(key)

    async def _ask(self, make: Callable[[int], object]):
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        key = next(self._ask_ids)
        reply = Reply()
        self._asks[key] = reply
        try:
            await self._link.send(make(key))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            self._asks.pop(key, None)
            self._link_lost = True
            why = self.failure or f"instance {self.index}: its link is closed"
            raise EngineDeadError(why) from None
        return await reply.wait()

    async def snapshot(self) -> EngineSnapshot:
        answer: Snapshot = await self._ask(lambda k: AskSnapshot(key=k))
        if answer.snapshot is None:
            raise EngineDeadError(answer.error or "the instance's engine stopped")
        return answer.snapshot

    async def stats(self) -> InstanceStats:
        """The summary the monitor reports to the coordinator."""
        answer: Stats = await self._ask(lambda k: AskStats(key=k))
        if answer.stats is None:
            raise EngineDeadError(answer.error or "the instance's engine stopped")
        return answer.stats

    async def replace_policy(self, text: str) -> None:
        answer: PolicyReplaced = await self._ask(lambda k: ReplacePolicyText(key=k, text=text))
        if answer.engine_stopped:
            raise EngineDeadError(f"instance {self.index}: {answer.error}")
        if answer.error is not None:
            raise PolicyError(f"instance {self.index}: {answer.error}")

    async def close(self, *, detach: bool = False) -> None:
        """Stop the instance, or with `detach` leave it serving for the next front door."""
        self._closing = True
        self._end_live()
        try:
            await self._link.send(Detach() if detach else Shutdown())
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        await self._link.aclose()


def _kill_quietly(kill: Callable[[], None]) -> None:
    """A lost instance's process is ended where this machine can reach it (an instance that
    comes back must not serve what was dispatched again elsewhere)."""
    with contextlib.suppress(Exception):
        kill()
