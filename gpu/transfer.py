"""The per-instance transfer queue: every tensor an instance sends to another goes through it,
so compute goes on while activations are on the wire, and later traffic on the same link
(KunServe §4.2: KV exchanged between instances of a pipeline group) never delays them.

Sends use torch.distributed point-to-point in the group the instance joined (gloo on CPU, NCCL
on CUDA); a gloo send completes only once the receiver posts its receive. Two lanes, each one
sending thread: activations go out as soon as they are queued, even while a KV chunk is on the
wire; the KV lane sends one chunk at a time, in order, and before each chunk waits until no
activation is queued (the paper's "after a chunk, let a pending activation go first"), for at
most `yield_s`: a receiver that needs a KV chunk before it takes the next activation would
otherwise never let the activations drain (the group's scheduler waits for a request's KV
before running it, so this bound is a safety net, not the common path).

`fifo` (a group whose policy says `kv_exchange fifo`, the ablation without coordination):
every tensor goes through the activation lane's one thread, in the order it was queued, so an
activation queued behind KV chunks waits for all of them. This cannot deadlock the group: a
gloo send waits for its receiver to post the receive, and each member posts the receives of its
KV chunks from threads of their own (gpu/kv_exchange.py `KvReceiver`), in the order they are
sent, and never waits for an activation to do so; the chunks a group exchanges are queued when
it forms (and restores), before any activation, so no activation's receiver waits on a chunk
queued behind that activation.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

TransferKind = Literal["activation", "kv"]

Sender = Callable[[torch.Tensor, int, int], None]
"""(tensor, destination rank, tag): sends one tensor and returns once it is sent."""


def _dist_send(tensor: torch.Tensor, dst: int, tag: int) -> None:
    dist.send(tensor, dst=dst, tag=tag)


class TransferQueue:
    """Two lanes of sends (activations, KV), one thread each."""

    def __init__(self, send: Sender = _dist_send, *, yield_s: float = 0.05,
                 passes: tuple[type[BaseException], ...] = ()) -> None:
        self._send = send
        self._passes = passes
        """A send's errors of these kinds reach the compute thread as they are (they name what
        failed, and the caller acts on their kind: a lost group member, gpu/data_plane.py);
        any other as "the transfer thread failed: ..."."""
        self._yield_s = yield_s
        self._lanes: dict[str, collections.deque] = {"activation": collections.deque(),
                                                     "kv": collections.deque()}
        self._cond = threading.Condition()
        self._pending = {"activation": 0, "kv": 0}
        self._closed = False
        self._error: BaseException | None = None
        self.sent_bytes = {"activation": 0, "kv": 0}
        """Bytes sent so far, by kind."""
        self.kv_yields = 0
        """Times a KV chunk waited for queued activations to go first."""
        self.fifo = False
        """One lane for both kinds, in queue order (no priority for activations)."""
        self._threads = [threading.Thread(target=self._loop, args=(kind,), daemon=True,
                                          name=f"shunter-transfer-{kind}")
                         for kind in ("activation", "kv")]
        for t in self._threads:
            t.start()

    def put_activation(self, tensor: torch.Tensor, *, dst: int, tag: int) -> None:
        self.put(tensor, dst=dst, tag=tag, kind="activation")

    def put(self, tensor: torch.Tensor, *, dst: int, tag: int, kind: TransferKind) -> None:
        with self._cond:
            self._raise_error()
            self._lanes["activation" if self.fifo else kind].append((tensor, dst, tag, kind))
            self._pending[kind] += 1
            self._cond.notify_all()

    def flush(self, kind: TransferKind | None = None) -> None:
        """Wait until everything queued (of `kind`, or of every kind) has been sent."""
        kinds = (kind,) if kind is not None else tuple(self._pending)
        with self._cond:
            while any(self._pending[k] for k in kinds) and self._error is None:
                self._cond.wait()
            self._raise_error()

    def _raise_error(self) -> None:
        if self._error is None:
            return
        if isinstance(self._error, self._passes):
            raise self._error
        raise RuntimeError(f"the transfer thread failed: {self._error}") from self._error

    def close(self, timeout: float = 5.0) -> None:
        """Stop the sending threads (what is still queued is not sent); a thread blocked in a
        send (its receiver never posted the receive) is left behind after `timeout`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=timeout)

    def _loop(self, kind: str) -> None:
        lane, acts = self._lanes[kind], self._lanes["activation"]
        while True:
            with self._cond:
                while not self._closed and self._error is None and not lane:
                    self._cond.wait()
                if kind == "kv" and acts:  # let queued activations go first, for a while
                    self.kv_yields += 1
                    until = time.monotonic() + self._yield_s
                    while acts and not self._closed and time.monotonic() < until:
                        self._cond.wait(until - time.monotonic())
                if self._closed or self._error is not None:
                    return
                tensor, dst, tag, sort = lane.popleft()
            try:
                self._send(tensor, dst, tag)
            except BaseException as exc:  # noqa: BLE001 (reported at the next put/flush)
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self.sent_bytes[sort] += tensor.numel() * tensor.element_size()
                self._pending[sort] -= 1
                self._cond.notify_all()
