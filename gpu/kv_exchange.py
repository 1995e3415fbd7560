"""KV exchange between the members of a pipeline group (KunServe §4.2), over the group's own
channel of the data plane (gpu/data_plane.py `open_channel`).

A `KvTransfer` is one request's KV for a range of layers, from one member to another. Both ends
cut the transfers between a pair into the same chunks of `chunk_blocks` blocks, in the same
order, so a chunk's tag says which it is. The sender gathers everything it will send first (the
blocks it reads are about to become free blocks of the group), then queues the chunks on the
instance's transfer queue as kind `kv`: an activation queued meanwhile goes out before the next
chunk. The receiver has one thread per source, writes each chunk into the request's staging
tensor, and marks a request ready once all of its chunks (from every source) are in; whoever
needs a request's KV waits for exactly that request (`wait`). Bytes, chunks and per-request
arrival times are counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import attrs
import torch

from gpu.data_plane import KV_TAG, Channel, GroupMemberLost

_EPOCH = 1 << 23


@attrs.frozen(kw_only=True)
class KvTransfer:
    request_id: int
    src: int
    """Member index (pipeline order) sending."""
    dst: int
    layers: range
    """Global layer indices carried."""
    blocks: int
    """The request's first `blocks` blocks."""


def pair_chunks(transfers: Sequence[KvTransfer], src: int, dst: int,
                chunk_blocks: int) -> list[tuple[KvTransfer, int, int]]:
    """(transfer, first block, stop block) of every chunk from src to dst, in tag order."""
    out = []
    for t in transfers:
        if t.src == src and t.dst == dst:
            out.extend((t, lo, min(lo + chunk_blocks, t.blocks))
                       for lo in range(0, t.blocks, chunk_blocks))
    return out


def _tag(epoch: int, seq: int) -> int:
    return KV_TAG + (epoch % 16) * _EPOCH + seq % _EPOCH


@attrs.define(eq=False)
class ExchangeStats:
    sent_bytes: int = 0
    received_bytes: int = 0
    chunks_sent: int = 0
    chunks_received: int = 0
    gather_s: float = 0.0
    ready_s: dict[int, float] = attrs.Factory(dict)
    """Request id -> seconds from the exchange's start until all its chunks were in."""


def send_transfers(plane: Channel, ranks: Sequence[int], me: int,
                   transfers: Sequence[KvTransfer], chunk_blocks: int, epoch: int,
                   gather: Callable[[KvTransfer], torch.Tensor], stats: ExchangeStats) -> None:
    """Gather every transfer this member sends ([blocks, layers, 2, bs, Hkv, D] each), then
    queue their chunks (kind kv) to each destination."""
    began = time.perf_counter()
    mine = [t for t in transfers if t.src == me]
    staged = {id(t): gather(t).contiguous() for t in mine}
    stats.gather_s += time.perf_counter() - began
    for dst in sorted({t.dst for t in mine}):
        for seq, (t, lo, hi) in enumerate(pair_chunks(transfers, me, dst, chunk_blocks)):
            chunk = staged[id(t)][lo:hi]
            plane.queue.put(chunk, dst=ranks[dst], tag=_tag(epoch, seq), kind="kv")
            stats.sent_bytes += chunk.numel() * chunk.element_size()
            stats.chunks_sent += 1


class KvReceiver:
    """Receives every transfer addressed to member `me`; one thread per source."""

    def __init__(self, ranks: Sequence[int], me: int, transfers: Sequence[KvTransfer],
                 chunk_blocks: int, epoch: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, stats: ExchangeStats, *, link: Channel) -> None:
        """`block_shape`: one layer of one block, (2, block_size, Hkv, D); `link`: the group's
        channel the chunks come over."""
        self._link = link
        self._mine = [t for t in transfers if t.dst == me]
        self.staging = {id(t): torch.empty((t.blocks, len(t.layers), *block_shape), dtype=dtype)
                        for t in self._mine}
        self._pending: dict[int, int] = {}
        for t in self._mine:
            self._pending[t.request_id] = self._pending.get(t.request_id, 0) + 1
        self._cond = threading.Condition()
        self._arrived: list[int] = [r for r, n in self._pending.items() if n == 0]
        self._error: GroupMemberLost | None = None
        self.stats = stats
        self._began = time.perf_counter()
        self._threads = [
            threading.Thread(target=self._loop, args=(ranks[src], pair_chunks(
                transfers, src, me, chunk_blocks), epoch), daemon=True,
                name=f"shunter-kv-recv-{src}")
            for src in sorted({t.src for t in self._mine})]
        for th in self._threads:
            th.start()

    def _loop(self, rank: int, chunks: list[tuple[KvTransfer, int, int]], epoch: int) -> None:
        left: dict[int, int] = {}
        for t, _, _ in chunks:
            left[id(t)] = left.get(id(t), 0) + 1
        for seq, (t, lo, hi) in enumerate(chunks):
            dst = self.staging[id(t)][lo:hi]
            try:
                self._link.recv_tensor(dst, rank, _tag(epoch, seq), "its KV was being exchanged")
            except GroupMemberLost as exc:
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self.stats.received_bytes += dst.numel() * dst.element_size()
                self.stats.chunks_received += 1
                left[id(t)] -= 1
                if left[id(t)] == 0:
                    self._pending[t.request_id] -= 1
                    if self._pending[t.request_id] == 0:
                        self._arrived.append(t.request_id)
                        self.stats.ready_s[t.request_id] = time.perf_counter() - self._began
                self._cond.notify_all()

    def expects(self, request_id: int) -> bool:
        return request_id in self._pending

    def wait(self, request_id: int) -> list[tuple[KvTransfer, torch.Tensor]]:
        """Block until every transfer of `request_id` to this member is in; returns them
        with their staged data (and forgets them)."""
        with self._cond:
            while self._pending.get(request_id, 0) and self._error is None:
                self._cond.wait()
            if self._pending.get(request_id, 0):
                raise self._error
            self._pending.pop(request_id, None)
        return [(t, self.staging.pop(id(t))) for t in self._mine
                if t.request_id == request_id and id(t) in self.staging]

    def take_arrived(self) -> list[int]:
        """Requests complete here since the last call."""
        with self._cond:
            out, self._arrived = self._arrived, []
        return out

    def pending(self) -> set[int]:
        with self._cond:
            return {r for r, n in self._pending.items() if n}

    def join(self, timeout: float | None = None) -> None:
        for th in self._threads:
            th.join(timeout)
        if self._error is not None:
            raise self._error
