"""Two parts of the data plane's links (gpu/data_plane.py): `Watch`, which tells whether the
other instances of the world still run, and `Held`, through which a group's channel reaches its
process group, so that what waits in a broken group's process group ends at once and the
process group is let go."""

from __future__ import annotations

import datetime
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist


class Watch:
    """Whether the other instances of the world still run: one TCP connection to each, made as
    the world is joined and never written to. A process that ends (killed included) has its
    kernel close its sockets, so the connection to it reads end-of-stream at its peers at once,
    whatever host they are on; `lost` reads that without blocking. A host that goes down
    without closing them is found by the front door's heartbeat (shunter/cluster/heartbeat.py),
    which tells the others (`mark_lost`)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, address: str,
                 timeout_s: float) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._listener = socket.create_server((address, 0), family=family,
                                              backlog=max(1, world_size))
        self._accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="data-plane-watch").start()
        host, port = self._listener.getsockname()[:2]
        store.set(f"shunter/watch/{rank}", f"{host} {port}")
        self._peers: dict[int, socket.socket] = {}
        for r in range(world_size):
            if r != rank:
                peer_host, peer_port = store.get(f"shunter/watch/{r}").decode().split()
                conn = socket.create_connection((peer_host, int(peer_port)), timeout=timeout_s)
                conn.setblocking(False)
                self._peers[r] = conn
        self._lost: set[int] = set()
        self._silent: set[int] = set()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed: the instance left the data plane
                return
            self._accepted.append(conn)  # held open while this process lives

    def lost(self, ranks: Sequence[int]) -> list[int]:
        for r in ranks:
            conn = self._peers.get(r)
            if conn is None or r in self._lost:
                continue
            try:
                if conn.recv(1, socket.MSG_PEEK) == b"":
                    self._lost.add(r)
            except BlockingIOError:  # nothing to read: it still runs
                pass
            except OSError:  # reset
                self._lost.add(r)
        return [r for r in ranks if r in self._lost]

    def mark_lost(self, rank: int) -> None:
        """The front door found `rank` silent (its host cut off: no connection of it closes)."""
        self._silent.add(rank)
        self._lost.add(rank)

    def why(self, rank: int) -> str:
        return ("the front door found it silent" if rank in self._silent
                else "its process is gone")

    def close(self) -> None:
        for conn in [self._listener, *self._peers.values(), *self._accepted]:
            conn.close()


class Broken(RuntimeError):
    """A group's channel was broken on purpose (`Held`): member `rank` is known lost (-1: the
    group ended without a loss named), `why` says how it was found."""

    def __init__(self, rank: int, why: str) -> None:
        super().__init__(why)
        self.rank, self.why = rank, why


Lost = Callable[[], "tuple[int, str] | None"]
"""(rank, why) of a member of the group known lost, or None."""
Poke = Callable[[Any], Any]
"""Posts, on the process group, a receive nothing will ever match (see `Held`)."""

BREAK_WAIT = datetime.timedelta(milliseconds=1)


class Held:
    """A group's process group as its channel's sends and receives reach it.

    gloo cannot cancel one posted send or receive (torch 2.13: `Work` has no `abort`, gloo's
    `ProcessGroup.abort`/`shutdown` do nothing, `is_completed` stays False until `wait`), but an
    operation whose wait times out closes every connection of its process group at once, and
    with them every other operation posted in it, here ("Application timeout caused pair
    closure") and at the peers ("Connection closed by peer"). `Held` breaks the group's process
    group that way (`_break`: a receive nothing matches, waited 1 ms) when the group is over:
    - a member is known lost (`lost`, the data plane's watch: its process gone, or the front
      door found it silent): a thread of this `Held` looks at the watch every `poll_s` while a
      send or receive waits, so nothing waits on a lost member beyond the watch's knowing it
      (gloo's own timeout was 60 s); what waited ends with `Broken` naming the member;
    - the group broke (`release`) while one of ours still waits: it ends at once, and so does
      what the peers still wait for on it.
    Once broken, every later send or receive fails at once (`Broken`), and the process group is
    let go as soon as no wait of ours is left in it."""

    def __init__(self, pg: Any, what: str, *, lost: Lost | None = None,
                 poke: Poke | None = None, poll_s: float = 0.02) -> None:
        self._pg, self._what = pg, what
        self._lost, self._poke, self._poll_s = lost, poke, poll_s
        self._busy = 0
        self._released = False
        self._broken: Broken | None = None
        self._over = False
        self._cond = threading.Condition()
        self.breaks = 0
        """Times this process group was broken with operations still waiting in it."""
        if lost is not None and poke is not None:
            threading.Thread(target=self._watch, daemon=True, name="group-channel-watch").start()

    def run(self, op: Callable[[Any], Any], wait: datetime.timedelta) -> None:
        """`op(pg)` posts one send or receive; wait for it (`Broken` once the group is over)."""
        with self._cond:
            if self._broken is None and self._lost is not None and (gone := self._lost()):
                self._broken = Broken(*gone)
            if self._broken is not None:
                raise Broken(self._broken.rank, self._broken.why)
            if self._pg is None:
                raise RuntimeError(f"{self._what} was closed (the group broke)")
            work = op(self._pg)  # (one that raises, naming no member, holds nothing)
            self._busy += 1
            self._cond.notify_all()
        try:
            work.wait(wait)
        except RuntimeError as exc:
            if self._broken is not None:  # broken on purpose: say why, not gloo's words
                raise Broken(self._broken.rank, self._broken.why) from exc
            raise
        finally:
            del work
            with self._cond:
                self._busy -= 1
                pg = self._let_go()
            del pg  # (outside the lock: its end may take a moment)

    def release(self) -> None:
        """The group broke: what still waits in it ends now (at the peers too)."""
        with self._cond:
            self._released = True
            waiting = self._busy > 0
            pg = self._let_go()
        del pg
        if waiting:
            self._break(Broken(-1, f"{self._what} was closed (the group broke)"))
        self.finish()

    def finish(self) -> None:
        """No more watching (the group ended, broken or not)."""
        with self._cond:
            self._over = True
            self._cond.notify_all()

    def _watch(self) -> None:
        while True:
            with self._cond:
                while not self._over and self._broken is None and not self._busy:
                    self._cond.wait()
                if self._over or self._broken is not None:
                    return
                self._cond.wait(self._poll_s)
                gone = self._lost() if self._busy else None
            if gone:
                self._break(Broken(*gone))
                return

    def _break(self, why: Broken) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = why
            self._released = True  # let go once the waits it ends are out
            poke = bool(self._busy) and self._poke is not None and self._pg is not None
            pg = self._pg if poke else self._let_go()
            self.breaks += poke
        if poke:
            try:
                self._poke(pg).wait(BREAK_WAIT)
            except RuntimeError:
                pass  # the timeout that closed the process group's connections
        del pg

    def _let_go(self) -> Any:
        if not (self._released and self._busy == 0):
            return None
        pg, self._pg = self._pg, None
        return pg


FOREVER = datetime.timedelta(days=365)


class Waiter:
    """Waits for posted gloo operations (the world's control messages) on threads of its own, so
    their caller can wait in slices and look at the watch between them. An operation whose peer
    is known lost is left waiting (gloo cannot cancel it; its thread stays parked, counted in
    `left`): a lost instance never sends again, so it matches nothing. Its thread waits with no
    gloo timeout, because a gloo timeout closes every connection of the world at this instance
    (and with them every later control message); the caller's own limit breaks the world only
    where gloo's would have (a live peer silent for the whole limit)."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()
        self.threads = 0
        self.left = 0
        """Operations left waiting on a peer known lost."""

    def wait(self, job: Callable[[], Any], lost: Callable[[], bool], limit_s: float,
             poll_s: float) -> tuple[str, Any]:
        """Run `job` (it waits for posted operations, with `FOREVER`) on a waiting thread:
        ("done", what it returned) (raises what it raised), ("lost", None) (the peer is known
        lost; what it waits for stays posted) or ("timeout", None) (`limit_s` passed)."""
        box: list = []
        done = threading.Event()
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
            if jobs is None:
                self.threads += 1
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), daemon=True,
                             name="data-plane-wait").start()
        jobs.put((job, box, done))
        until = time.monotonic() + limit_s
        while not done.wait(poll_s):
            if lost():
                with self._lock:
                    self.left += 1
                return "lost", None
            if time.monotonic() >= until:
                return "timeout", None
        if isinstance(box[0], BaseException):
            raise box[0]
        return "done", box[0][0]

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while True:
            job, box, done = jobs.get()
            try:
                box.append((job(),))
            except BaseException as exc:  # noqa: BLE001 (raised by the waiting caller)
                box.append(exc)
            del job
            done.set()
            with self._lock:
                self._idle.append(jobs)
