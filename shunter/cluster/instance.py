"""The instance side: one Engine in its own process, serving the front door over one control
link (shunter/cluster/wire.py). The process ends when the link closes, or when the front door
went silent without closing it (no message for the bound its pings carry,
shunter/cluster/heartbeat.py `FrontDoorWatch`): an instance never outlives the cluster that
started it. Either way every request it holds is cancelled (its blocks freed) and the process
ends, so a group it leads or serves in finds it gone at once (gpu/data_plane.py `Watch`)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
from collections.abc import Callable

import anyio
import attrs
import structlog
from anyio.abc import SocketAttribute

from engine.config import EngineConfig
from engine.errors import EngineDeadError, PolicyError
from engine.messages import AbortRequest, Submit
from engine.outputs import Admitted, GenerationChunk, Rejected
from shunter.cluster.group_wire import GroupCommand
from shunter.cluster.heartbeat import FrontDoorWatch
from shunter.cluster.instance_groups import InstanceGroups
from shunter.cluster.wire import (
    AskSnapshot,
    AskStats,
    CancelRequest,
    Detach,
    Hello,
    Link,
    Output,
    PeerLost,
    Ping,
    PolicyReplaced,
    Pong,
    ReplacePolicyText,
    Shutdown,
    Snapshot,
    Stats,
    SubmitRequest,
    summarize,
)
from shunter.engine import Engine

log = structlog.get_logger(actor="instance")


def instance_process(config: EngineConfig, host: str, conn, async_backend: str,
                     netns: str = "") -> None:
    """Entry point of a local instance process: `conn` (a multiprocessing pipe) gets the port
    the instance listens on, or the error that stopped it from starting. Ctrl-C in a terminal
    signals the whole process group: it is the front door's to act on (it drains, then closes
    the link, which ends this process), so SIGINT is ignored here. `netns`: the network
    namespace to run in (entered first, before any thread or socket is made)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if netns:
            enter_netns(netns)
        anyio.run(serve_instance, config, host, conn.send, backend=async_backend)
    except Exception as exc:  # noqa: BLE001 (reported to the front door, which names the instance)
        try:
            conn.send(f"{type(exc).__name__}: {exc}")
        except OSError:
            pass


def enter_netns(name: str) -> None:
    """Move this thread into the network namespace `name` (`ip netns add NAME`; root only).
    Threads started after it inherit it, so call it before any."""
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{name}") as f:
        if libc.setns(f.fileno(), clone_newnet) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot enter network namespace {name!r}: {os.strerror(err)}")


def configure_logging() -> None:
    """An instance process logs as an engine does (engine/logs.py: INFO and up, to stderr,
    tracebacks printed plainly). With rich's tracebacks the executor's "step failed" of a head
    whose group lost a member took seconds of the event loop that answers the front door's
    pings, so a head recovering at load 8-10 was found silent
    (tests/cluster/test_heartbeat_logging.py). A process whose structlog is configured already
    keeps its configuration."""
    from engine.logs import configure_default

    configure_default()


async def serve_instance(config: EngineConfig, host: str,
                         report: Callable[[object], None]) -> None:
    """Start the engine, listen on `host` (an ephemeral port, sent through `report`), serve the
    first connection until it closes."""
    configure_logging()
    async with Engine.start(config) as engine:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=0)
        async with listener:
            report(listener.extra(SocketAttribute.local_port))
            # a link that closes without Detach (the front door went away) ends the instance
            while await InstanceServer(engine, Link(await listener.listeners[0].accept())).run():
                pass


class InstanceServer:
    def __init__(self, engine: Engine, link: Link) -> None:
        self._engine = engine
        self._link = link
        self._ids: dict[int, int] = {}
        """Cluster key -> this engine's request id, once admitted."""
        self._cancelled: set[int] = set()
        self._moved: dict[int, anyio.Event] = {}
        """Keys whose requests moved to a group's head: their relays end without a last chunk
        (KunServe; shunter/cluster/instance_groups.py), the event set once they have."""
        self._tg: anyio.abc.TaskGroup | None = None
        self.groups = InstanceGroups(engine, self)
        self.front_door = FrontDoorWatch()
        self.silent: str | None = None
        """Why this instance stopped serving a front door that went silent."""

    async def send(self, msg) -> None:
        """To the front door. A link that has gone takes nothing: the reader sees it end and
        ends the serving (a send's error must not end the process, nor a detached instance
        that waits for the next front door)."""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self._link.send(msg)

    def keys_of(self, ids) -> dict[int, int]:
        want = set(ids)
        return {rid: key for key, rid in self._ids.items() if rid in want}

    def mark_moved(self, keys) -> None:
        for key in keys:
            self._moved[key] = anyio.Event()

    async def drained(self, keys) -> None:
        for key in keys:
            await self._moved[key].wait()
            del self._moved[key]

    async def cancel_if_asked(self, key: int, request_id: int) -> None:
        """A request that moved here, once this engine's scheduler holds it: a cancel its
        client sent while it was moving (before this engine could apply it) applies now."""
        if key in self._cancelled:
            self._engine._cancel_nowait(request_id)  # its stream is gone
            # straight to the scheduler: a cancel that came while the request was moving may
            # have marked its stream gone already, its abort lost (the scheduler did not hold
            # it yet)
            await self._engine._scheduler_send.send(
                AbortRequest(request_id=request_id, reason="cancelled"))

    def relay(self, key: int, request_id: int, recv) -> None:
        self._ids[key] = request_id
        self._tg.start_soon(self._relay, key, recv, True)

    async def run(self) -> bool:
        """Serve the link until it closes; True when the front door detached (serve the
        next one), False when the instance should end."""
        detached = False
        await self.send(Hello(pid=os.getpid(), block_size=self._engine.config.block_size,
                                    vocab_size=self._engine.backend.vocab_size,
                                    policy_source=self._engine.policy.source))
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self.front_door.run, self._front_door_silent)
            while True:
                try:
                    msg = await self._link.receive()
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                        anyio.ClosedResourceError, OSError):
                    break
                self.front_door.heard(msg)
                match msg:
                    case Ping(seq=seq):  # here, not on the device thread: a long step
                        await self.send(Pong(seq=seq))  # does not delay it
                    case PeerLost(index=index):
                        peer_lost(index)
                    case SubmitRequest():
                        tg.start_soon(self._serve, msg)
                    case CancelRequest(key=key):
                        self._cancelled.add(key)
                        if key in self._ids:
                            self._engine._cancel_nowait(self._ids[key])
                    case AskSnapshot(key=key):
                        tg.start_soon(self._snapshot, key)
                    case AskStats(key=key):
                        tg.start_soon(self._stats, key)
                    case ReplacePolicyText(key=key, text=text):
                        tg.start_soon(self._replace, key, text)
                    case _ if isinstance(msg, GroupCommand):  # KunServe groups
                        tg.start_soon(self.groups.handle, msg, tg)
                    case Shutdown():
                        break
                    case Detach():
                        detached = True
                        break
            tg.cancel_scope.cancel()
        for request_id in self._ids.values():  # nobody hears them now: free their blocks at once
            self._engine._cancel_nowait(request_id)
        if self.silent is not None:
            log.warning("front door silent: this instance ends", reason=self.silent,
                        cancelled=sorted(self._ids.values()))
        with contextlib.suppress(Exception):
            await self._link.aclose()
        return detached

    async def _front_door_silent(self, reason: str) -> None:
        """Stop serving as when the link closes (the reader sees it closed), and say why."""
        self.silent = reason
        with contextlib.suppress(Exception):
            await self._link.aclose()

    async def _serve(self, msg: SubmitRequest) -> None:
        send, recv = anyio.create_memory_object_stream(math.inf)
        submit = Submit(prompt=msg.prompt, prompt_ids=msg.prompt_ids, sampling=msg.sampling,
                        scheduling=msg.scheduling, outputs=send, stream=msg.stream)
        try:
            await self._engine._submit(submit)
        except EngineDeadError as exc:
            await self.send(Output(key=msg.key, output=Rejected(error=exc)))
            return
        await self._relay(msg.key, recv)

    async def _relay(self, key: int, recv, admitted: bool = False) -> None:
        ended = False
        async with recv:
            async for out in recv:
                if isinstance(out, Admitted):
                    admitted = True
                    self._ids[key] = out.request_id
                    if key in self._cancelled:
                        self._engine._cancel_nowait(out.request_id)
                await self.send(Output(key=key, output=_portable(out)))
                if isinstance(out, Rejected) or (isinstance(out, GenerationChunk)
                                                 and out.finish_reason is not None):
                    ended = True
                    break
        moved = self._moved.get(key)
        if moved is not None:  # it goes on at a group's head, relayed from there
            moved.set()
        elif not ended:  # the engine stopped under the request (an actor failed)
            reason = self._engine.stopped_reason()
            # one it never admitted (queued as it stopped) is refused: the client still waits
            # for its admission answer, and the front door serves it elsewhere
            last = stopped_chunk(reason) if admitted else Rejected(error=EngineDeadError(reason))
            await self.send(Output(key=key, output=last))
        self._ids.pop(key, None)
        self._cancelled.discard(key)

    async def _snapshot(self, key: int) -> None:
        try:
            snap, error = await self._engine.inspect(), None
        except EngineDeadError as exc:
            snap, error = None, str(exc)
        await self.send(Snapshot(key=key, snapshot=snap, error=error))

    async def _stats(self, key: int) -> None:
        try:
            stats, error = summarize(await self._engine.inspect()), None
        except EngineDeadError as exc:
            stats, error = None, str(exc)
        await self.send(Stats(key=key, stats=stats, error=error))

    async def _replace(self, key: int, text: str) -> None:
        error, stopped = None, False
        try:
            await self._engine.replace_policy(text)
        except PolicyError as exc:
            error = str(exc)
        except EngineDeadError as exc:
            error, stopped = str(exc), True
        await self.send(PolicyReplaced(key=key, error=error, engine_stopped=stopped))


def peer_lost(index: int) -> bool:
    """Tell this instance's data plane (if it joined one) that instance `index` is lost."""
    plane = sys.modules.get("gpu.data_plane")  # never joined when not imported
    return plane is not None and plane.peer_lost(index)


def stopped_chunk(reason: str) -> GenerationChunk:
    """The last chunk of a request whose engine stopped before it ended."""
    return GenerationChunk(request_id=0, token_ids=(), text="", finish_reason="error",
                           error=reason)


def _portable(out):
    """An output as it can cross the link: a rejection's error is rebuilt from its type and
    message (exceptions with extra constructor arguments do not unpickle)."""
    if isinstance(out, Rejected):
        return attrs.evolve(out, error=type(out.error)(str(out.error)))
    return out
