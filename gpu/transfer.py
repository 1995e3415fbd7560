"""The per-instance transfer queue: every tensor an instance sends to another goes through one
queue and one sending thread, so compute goes on while activations are on the wire, and
later traffic on the same link (KunServe §4.3: KV exchanged between instances of a pipeline
group) waits behind activations instead of delaying them.

Sends use torch.distributed point-to-point in the group the instance joined (gloo on CPU, NCCL
on CUDA). Activations go before any queued KV transfer; within a kind, in order.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

TransferKind = Literal["activation", "kv"]
_RANK = {"activation": 0, "kv": 1}

Sender = Callable[[torch.Tensor, int, int], None]
"""(tensor, destination rank, tag): sends one tensor and returns once it is sent."""


def _dist_send(tensor: torch.Tensor, dst: int, tag: int) -> None:
    dist.send(tensor, dst=dst, tag=tag)


class TransferQueue:
    """A priority queue of sends served by one thread."""

    def __init__(self, send: Sender = _dist_send) -> None:
        self._send = send
        self._heap: list[tuple[int, int, torch.Tensor, int, int]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._pending = 0
        self._closed = False
        self._error: BaseException | None = None
        self.sent_bytes = {"activation": 0, "kv": 0}
        """Bytes sent so far, by kind."""
        self._thread = threading.Thread(target=self._loop, name="shunter-transfer", daemon=True)
        self._thread.start()

    def put_activation(self, tensor: torch.Tensor, *, dst: int, tag: int) -> None:
        self.put(tensor, dst=dst, tag=tag, kind="activation")

    def put(self, tensor: torch.Tensor, *, dst: int, tag: int, kind: TransferKind) -> None:
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"the transfer thread failed: {self._error}")
            heapq.heappush(self._heap, (_RANK[kind], next(self._order), tensor, dst, tag))
            self._pending += 1
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until everything queued has been sent."""
        with self._cond:
            while self._pending and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise RuntimeError(f"the transfer thread failed: {self._error}")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if not self._heap:
                    return
                rank, _, tensor, dst, tag = heapq.heappop(self._heap)
            try:
                self._send(tensor, dst, tag)
            except BaseException as exc:  # reported to the compute thread at its next put/flush
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self.sent_bytes["activation" if rank == 0 else "kv"] += (
                    tensor.numel() * tensor.element_size())
                self._pending -= 1
                self._cond.notify_all()
