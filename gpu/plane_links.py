"""Two parts of the data plane's links (gpu/data_plane.py): `Watch`, which tells whether the
other instances of the world still run, and `Held`, through which a group's channel reaches its
process group, so that a broken group's process group can be let go."""

from __future__ import annotations

import datetime
import socket
import threading
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


class Held:
    """A group's process group as its channel's sends and receives reach it. `release` (the
    group broke) lets it go as soon as no send or receive of this process waits in it: once
    nothing holds it, gloo closes its connections, and what a peer still waits for on them ends
    at once ("Connection closed by peer") instead of after gloo's timeout. While one of ours
    waits in it (for a peer that will not send), it is let go when that wait ends (the timeout):
    a waiting operation keeps gloo's side alive anyway (let go under one, in a two-process
    check, neither end's wait ended before the timeout)."""

    def __init__(self, pg: Any, what: str) -> None:
        self._pg, self._what = pg, what
        self._busy = 0
        self._released = False
        self._lock = threading.Lock()

    def run(self, op: Callable[[Any], Any], wait: datetime.timedelta) -> None:
        """`op(pg)` posts one send or receive; wait for it."""
        with self._lock:
            if self._pg is None:
                raise RuntimeError(f"{self._what} was closed (the group broke)")
            work = op(self._pg)  # (one that raises, naming no member, holds nothing)
            self._busy += 1
        try:
            work.wait(wait)
        finally:
            del work
            with self._lock:
                self._busy -= 1
                pg = self._let_go()
            del pg  # (outside the lock: its end may take a moment)

    def release(self) -> None:
        with self._lock:
            self._released = True
            pg = self._let_go()
        del pg

    def _let_go(self) -> Any:
        if not (self._released and self._busy == 0):
            return None
        pg, self._pg = self._pg, None
        return pg
