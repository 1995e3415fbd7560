"""The data plane between instance processes: one world process group (rank = instance
index; gloo on CPU, NCCL on CUDA) for the few typed control messages a pipeline group's head
sends its members (pickled attrs messages as byte tensors), and a channel of its own per
pipeline group for the group's tensors (activations, KV chunks, restored weights). Both meet
over a TCPStore that instance 0 serves; gloo listens on the address each instance reaches
instance 0 from (`route_address`), not on what the host name resolves to (often loopback:
peers on other machines could not connect).

A group's channel (`open_channel`) is a process group of only its members, made over the world's
store under a prefix no other group uses, with its own transfer queue (gpu/transfer.py:
activations before KV). gloo cannot cancel a posted send or receive, and a group that breaks
while its KV exchange runs leaves some (a receive for a chunk its sender never sent, a send whose
receiver left): on the world they would match a later group's messages between the same
instances (same tags), and a chunk of the wrong size kills the receiving process. On the
channel of a group that is gone, nothing is ever sent or received again.

Every instance holds a TCP connection to every other one (`Watch`, made as the world is joined,
never written to): a process that ends, killed included, has its kernel close them, so the
members opening a group's channel learn at once that one of them is gone and give the group up,
instead of waiting `channel_open_s` for it. A host that goes down without closing them is found
by the front door's heartbeat, which tells the others (`peer_lost`). Nothing already posted
waits on a member the watch knows gone: a channel's process group is broken then (`Held`: its
sends and receives end at once, at the other members too), and a control message's wait on the
world ends while its operation stays posted, matching nothing (`_wait`, `Waiter`).

Tags keep the traffic apart: activations use gpu.pipeline_stage's step/microbatch tags (below
2**28), KV chunks count up from 2**28 per (source, destination), control from 2**29.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import pickle
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs
import torch
import torch.distributed as dist

from gpu.plane_links import BREAK_WAIT, FOREVER, Broken, Held, Waiter, Watch
from gpu.transfer import Sender, TransferQueue

FAULT_ENV = "SHUNTER_TEST_FAULT"
"""Tests' fault injection (`fault_point`): `<point>@<rank>` makes the instance of that data-plane
rank SIGKILL itself when it reaches `point`, read when the point is reached (unset: nothing
happens). Points: `channel-open` (as it starts to open a group's channel; a member: after its
`GroupGo`), and in a growth (gpu/group_grow.py) `grow-go` (a member, its `GroupGo` received,
before it re-splits or joins) and `grow-joined` (a new member, once it joined and sent the
gained layers)."""
WATCH_POLL_S = 0.01
"""How often a member opening a group's channel looks whether another member is gone."""

KV_TAG = 1 << 28
CONTROL_TAG = 1 << 29
REPLY_TAG = CONTROL_TAG + 4
WEIGHTS_TAG = CONTROL_TAG + 8
BREAK_TAG = CONTROL_TAG + 12
"""A channel's receive that nothing ever matches, posted to break its process group (`Held`)."""


class GroupMemberLost(RuntimeError):
    """A member of the pipeline group stopped answering (its process died or its link broke)."""

    def __init__(self, rank: int, what: str, cause: BaseException) -> None:
        super().__init__(f"pipeline group member instance {rank} was lost while {what}: "
                         f"{type(cause).__name__}: {str(cause)[:200]}")
        self.rank = rank


@attrs.define(eq=False)
class DataPlane:
    rank: int
    world_size: int
    store: dist.Store | None = None
    """The world's rendezvous store (groups' channels meet under prefixes of it)."""
    backend: str = "gloo"
    timeout_s: float = 60.0
    """How long one send or receive may wait."""
    channel_open_s: float = 10.0
    """How long the members of a group wait for each other to open its channel: they open it
    within a control message of each other (at `GroupGo`). A member whose process ended before
    it opened the channel is seen at once (`watch`); this bounds only what one that hangs, or
    whose host went down, costs the others."""
    address: str = ""
    """This machine's address on the interface that reaches the rendezvous: gloo listens there
    for the world and every channel (peers on other machines connect to it; the host name may
    resolve to loopback). "": gloo's default (the host name's address)."""
    world: Any = None
    """The world's process group (control messages)."""
    watch: Watch | None = None
    """Which other instances of the world are gone (None: not watched)."""
    waiter: Waiter = attrs.Factory(Waiter)
    """Waits for the world's control messages while the caller watches (`_wait`)."""

    def lost(self, ranks: Sequence[int]) -> list[int]:
        """Those of `ranks` whose process is known to be gone."""
        return [] if self.watch is None else self.watch.lost(ranks)

    def why(self, rank: int) -> str:
        """How the watch knows `rank` is gone."""
        return "its process is gone" if self.watch is None else self.watch.why(rank)

    def lost_error(self, rank: int, what: str) -> GroupMemberLost:
        """The error for member `rank`, which the watch knows is gone, lost while `what`."""
        return GroupMemberLost(rank, what, RuntimeError(self.why(rank)))


Receiver = Callable[[torch.Tensor, int, int], None]
"""(tensor, source rank, tag): receives one tensor into `tensor`."""


class Channel:
    """One pipeline group's link between its members: `queue` sends (activations before KV),
    `recv_tensor` receives; both name world ranks. Stand-ins for tests pass their own `send`
    and `recv`."""

    def __init__(self, ranks: Sequence[int], rank: int, send: Sender, recv: Receiver,
                 pg: Any = None) -> None:
        self.ranks = tuple(ranks)
        self.rank = rank
        """This instance's world rank."""
        self.queue = TransferQueue(send, passes=(GroupMemberLost,))
        self._recv = recv
        self._pg = pg
        self.held: Held | None = None
        """The process group as `open_channel`'s send and receive reach it (see `close`)."""

    def recv_tensor(self, t: torch.Tensor, src: int, tag: int, what: str) -> None:
        try:
            self._recv(t, src, tag)
        except GroupMemberLost:
            raise
        except RuntimeError as exc:  # the group broke, or gloo saw the peer's connections close
            raise _member_lost(exc, src, what) from exc

    def close(self, *, broken: bool = False) -> None:
        """The group is over. `broken`: it ended without its last transfers (a member was
        lost): its process group is broken and let go (`Held.release`), so every send or
        receive still waiting in it ends at once, here and at the other members; what it left
        posted can never match anything again."""
        if broken and self.held is not None:
            self.held.release()  # its sends waiting in gloo end now: their threads can stop
        self.queue.close(timeout=0.0 if broken else 5.0)
        self._pg = None
        if self.held is not None:
            self.held.finish()


_plane: DataPlane | None = None
_keys = itertools.count(1)


def new_channel_key(plane: DataPlane) -> str:
    """A key for the channel of a group this instance leads, used by no other group of the
    cluster (the leader's rank and its own count)."""
    return f"{plane.rank}.{next(_keys)}"


def open_channel(plane: DataPlane, key: str, ranks: Sequence[int]) -> Channel:
    """The group `ranks`' channel (blocks until every member opened it with the same `key`)."""
    ranks = tuple(ranks)
    if plane.rank not in ranks:
        raise ValueError(f"instance {plane.rank} is not a member of group {ranks}")
    if not key:
        raise ValueError(f"group {ranks}: a channel needs a key (new_channel_key)")
    if plane.store is None:
        raise RuntimeError("this data plane has no store: groups cannot open channels on it")
    me = ranks.index(plane.rank)
    fault_point("channel-open", plane.rank)
    pg = _open_watched(plane, ranks, lambda: _process_group(
        plane, f"shunter/group/{key}/", me, len(ranks), plane.channel_open_s))
    index = {r: i for i, r in enumerate(ranks)}

    def member(rank: int) -> int:
        if rank not in index:
            raise ValueError(f"instance {rank} is not a member of this group's channel "
                             f"(members {ranks}); a grown group opens a channel of its own")
        return index[rank]

    wait = datetime.timedelta(seconds=plane.timeout_s)  # the group was made with the shorter

    others = [r for r in ranks if r != plane.rank]

    def lost() -> tuple[int, str] | None:
        gone = plane.lost(others)
        return (gone[0], plane.why(gone[0])) if gone else None

    poke_at = member(others[0])
    held = Held(pg, f"the group {ranks}'s channel", lost=lost, poll_s=WATCH_POLL_S,
                poke=lambda g: g.recv([torch.zeros(1)], poke_at, BREAK_TAG))

    def send(tensor: torch.Tensor, dst: int, tag: int) -> None:
        try:
            held.run(lambda g: g.send([tensor], member(dst), tag), wait)
        except RuntimeError as exc:  # the group broke, or gloo saw the peer's connections close
            raise _member_lost(exc, dst, f"a tensor was being sent to instance {dst}") from exc

    def recv(tensor: torch.Tensor, src: int, tag: int) -> None:
        held.run(lambda g: g.recv([tensor], member(src), tag), wait)  # Broken: recv_tensor

    channel = Channel(ranks, plane.rank, send, recv, pg)
    channel.held = held
    del pg
    return channel


def _member_lost(exc: RuntimeError, peer: int, what: str) -> GroupMemberLost:
    """A channel's send or receive failed: its group broke (`Broken`: the member known lost,
    else the peer it was with), or gloo saw the peer's connections close (before the watch)."""
    if not isinstance(exc, Broken):
        return GroupMemberLost(peer, what, exc)
    return GroupMemberLost(peer if exc.rank < 0 else exc.rank, what, RuntimeError(exc.why))


def fault_point(point: str, rank: int) -> None:
    if os.environ.get(FAULT_ENV) == f"{point}@{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


def _open_watched(plane: DataPlane, ranks: tuple[int, ...], make: Callable[[], Any]) -> Any:
    """`make()` (a group's process group, which blocks until every member joined) on a thread
    of its own, while this one watches the members: one whose process is gone ends the wait at
    once (GroupMemberLost) instead of after `channel_open_s`. A process group made after all
    (the member went away once it had joined) is aborted; one never made fails on its own."""
    what = f"the group {ranks}'s channel was being opened"
    done: dict[str, Any] = {}
    given_up = threading.Event()

    def run() -> None:
        try:
            pg = make()
        except BaseException as exc:  # noqa: BLE001 (re-raised by the waiting thread)
            done["error"] = exc
            return
        done["pg"] = pg
        if given_up.is_set():
            pg.abort()

    opening = threading.Thread(target=run, daemon=True, name="group-channel-open")
    opening.start()
    while opening.is_alive():
        opening.join(WATCH_POLL_S)
        lost = plane.lost(ranks)
        if lost and opening.is_alive():
            given_up.set()
            if "pg" in done:  # made just now, after `run` looked
                done["pg"].abort()
            raise plane.lost_error(lost[0], what)
    if "error" in done:  # a member never came (it went away first)
        exc = done["error"]
        raise GroupMemberLost(-1, what, exc) from exc
    return done["pg"]


def _process_group(plane: DataPlane, prefix: str, rank: int, size: int,
                   open_s: float | None = None):
    """A process group of `size` over the plane's store under `prefix` (blocks until all
    `size` joined, at most `open_s`, default the plane's `timeout_s`: also the default wait
    of its operations)."""
    store = dist.PrefixStore(prefix, plane.store)
    timeout = datetime.timedelta(seconds=plane.timeout_s if open_s is None else open_s)
    if plane.backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size)
    if not plane.address:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=plane.address)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


def route_address(host: str, port: int) -> str:
    """This machine's address on the interface it would reach `host` through (no packet is
    sent: a UDP socket is only connected)."""
    family, kind, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as s:
        s.connect(addr)
        return s.getsockname()[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a rendezvous there (`host` "": every interface of
    this machine, where peers on other machines reach it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_data_plane(init_method: str, rank: int, world_size: int, *,
                    timeout_s: float = 60.0, backend: str = "gloo") -> DataPlane:
    """Join the cluster's world (blocks until every instance joined). Once per process.
    `init_method`: tcp://host:port, the rendezvous store's address (instance 0 serves it, on
    every interface); this instance's gloo listens on the address it reaches that host from."""
    global _plane
    if _plane is not None:
        raise RuntimeError(f"this process already joined the data plane as rank {_plane.rank}")
    url = urlsplit(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"data plane rendezvous {init_method!r}: expected tcp://host:port")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(url.hostname, url.port, world_size, rank == 0, timeout=timeout)
    plane = DataPlane(rank=rank, world_size=world_size, store=store, backend=backend,
                      timeout_s=timeout_s, address=route_address(url.hostname, url.port))
    plane.watch = Watch(store, rank, world_size, plane.address, timeout_s)
    plane.world = _process_group(plane, "shunter/world/", rank, world_size)
    _plane = plane
    return plane


def data_plane() -> DataPlane:
    if _plane is None:
        raise RuntimeError("this instance has not joined the data plane (join_data_plane)")
    return _plane


def leave_data_plane() -> None:
    global _plane
    if _plane is not None:
        _plane.world.abort()
        if _plane.watch is not None:
            _plane.watch.close()
        _plane = None


def peer_lost(rank: int) -> bool:
    """The front door declared instance `rank` lost (silent): a channel being opened with it,
    every message to or from it, and what already waits on it (a group's channel with it is
    broken; a control message's wait ends) fail at once from now on. False when this instance
    is not in a world."""
    if _plane is None or _plane.watch is None:
        return False
    _plane.watch.mark_lost(rank)
    return True


def send_obj(obj: Any, dst: int, tag: int, what: str) -> None:
    """Send one pickled message (its length first) to rank `dst`: GroupMemberLost at once when
    the watch knows it gone, and as soon as it does while the send waits (`_wait`)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                            dtype=torch.uint8)
    works = _post(dst, what, lambda w: [w.send([torch.tensor([data.numel()])], dst, tag),
                                        w.send([data], dst, tag + 1)])  # waited on a thread
    _wait(lambda: [w.wait(FOREVER) for w in works], dst, what)


def recv_obj(src: int, tag: int, what: str) -> Any:
    size, world = torch.empty(1, dtype=torch.int64), data_plane().world
    first = _post(src, what, lambda w: w.recv([size], src, tag))

    def job() -> torch.Tensor:
        first.wait(FOREVER)
        data = torch.empty(int(size), dtype=torch.uint8)
        world.recv([data], src, tag + 1).wait(FOREVER)
        return data

    return pickle.loads(_wait(job, src, what).numpy().tobytes())


def _wait(job: Callable[[], Any], peer: int, what: str) -> Any:
    """Run `job` (a control message's waits on its posted sends or receives with `peer`) on a
    waiting thread while this one looks at the watch every `WATCH_POLL_S`: a peer known lost
    (its process gone, or found silent by the front door) ends the wait at once; what the job
    waits for stays posted and matches nothing (`Waiter`). After the plane's `timeout_s` with
    the peer not known lost, the world's connections at this instance are closed, as gloo's
    own timeout does. Returns what `job` returned."""
    plane = data_plane()
    try:
        outcome, got = plane.waiter.wait(job, lambda: bool(plane.lost([peer])), plane.timeout_s,
                                         WATCH_POLL_S)
    except RuntimeError as exc:
        raise GroupMemberLost(peer, what, exc) from exc
    if outcome == "lost":
        raise plane.lost_error(peer, what)
    if outcome == "timeout":
        with contextlib.suppress(RuntimeError):
            plane.world.recv([torch.zeros(1)], peer, BREAK_TAG).wait(BREAK_WAIT)
        raise GroupMemberLost(peer, what, TimeoutError(
            f"no answer in {plane.timeout_s:.0f} s (the world's connections were closed)"))
    return got


def _post(peer: int, what: str, post: Callable[[Any], Any]) -> Any:
    """`post(world)` (a control message's sends or receives with `peer`) unless the watch knows
    `peer` gone. gloo refuses to post once it saw the peer's connections close, which can be
    before the watch sees its own close: the peer is lost then too, as when a wait fails."""
    plane = data_plane()
    if plane.lost([peer]):
        raise plane.lost_error(peer, what)
    try:
        return post(plane.world)
    except RuntimeError as exc:
        raise GroupMemberLost(peer, what, exc) from exc
