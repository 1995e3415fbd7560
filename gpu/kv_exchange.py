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

Whoever waits on a member (for a request's chunks, `KvReceiver.wait`; for activations,
`WatchedRecv`) waits in slices of `WATCH_SLICE_S` and looks at the data plane's watch between
them (`known_lost`): once any member of the group is gone, the group is broken, and the wait
ends at once with `GroupMemberLost` naming it (gloo cannot cancel a posted receive: it stays
posted on its thread until the channel is let go, `Channel.close(broken=True)`). Without this,
a wait on a live member of a broken group (one that will never send, having found the loss
itself) lasted gloo's whole timeout.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import attrs
import torch

from gpu.data_plane import KV_TAG, Channel, GroupMemberLost, data_plane

_EPOCH = 1 << 23
WATCH_SLICE_S = 0.02
"""How long a wait on a member goes between two looks at the data plane's watch."""


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
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    """Its counters are added to from several threads (each round's receiver, the restore's,
    the sender): `+=` on an attribute is not atomic, so every update takes this."""

    def add_received(self, nbytes: int) -> None:
        with self._lock:
            self.received_bytes += nbytes
            self.chunks_received += 1

    def add_sent(self, nbytes: int) -> None:
        with self._lock:
            self.sent_bytes += nbytes
            self.chunks_sent += 1

    def add_gather(self, seconds: float) -> None:
        with self._lock:
            self.gather_s += seconds


def send_transfers(plane: Channel, ranks: Sequence[int], me: int,
                   transfers: Sequence[KvTransfer], chunk_blocks: int, epoch: int,
                   gather: Callable[[KvTransfer], torch.Tensor], stats: ExchangeStats,
                   seq_base: int = 0) -> None:
    """Gather every transfer this member sends ([blocks, layers, 2, bs, Hkv, D] each), then
    queue their chunks (kind kv) to each destination; their tags' sequence numbers start at
    `seq_base` (a later round of the same epoch continues an earlier one's)."""
    began = time.perf_counter()
    mine = [t for t in transfers if t.src == me]
    staged = {id(t): gather(t).contiguous() for t in mine}
    stats.add_gather(time.perf_counter() - began)
    for dst in sorted({t.dst for t in mine}):
        for seq, (t, lo, hi) in enumerate(pair_chunks(transfers, me, dst, chunk_blocks)):
            chunk = staged[id(t)][lo:hi]
            plane.queue.put(chunk, dst=ranks[dst], tag=_tag(epoch, seq_base + seq), kind="kv")
            stats.add_sent(chunk.numel() * chunk.element_size())


def known_lost(ranks: Sequence[int]) -> list[int]:
    """Those of `ranks` the data plane's watch knows are gone ([] without a data plane, as in
    tests' stand-ins)."""
    try:
        return getattr(data_plane(), "lost", lambda ranks: [])(ranks)
    except RuntimeError:
        return []


def lost_error(rank: int, what: str) -> GroupMemberLost:
    """The data plane's error for a member its watch found gone (dead, or found silent by the
    front door); the plain one where there is no data plane (tests' stand-ins)."""
    try:
        return data_plane().lost_error(rank, what)
    except RuntimeError:
        return GroupMemberLost(rank, what, RuntimeError("its process is gone"))


class WatchedRecv:
    """A channel's receives, each on one thread of its own while the caller waits for it in
    slices and looks at the watch for every other member of the channel between them. The
    thread ends once this is dropped (or `close`)."""

    def __init__(self, link: Channel) -> None:
        self.link = link
        self._others = [r for r in link.ranks if r != link.rank]
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_receive_jobs, args=(link, self._jobs), daemon=True,
                         name="shunter-watched-recv").start()

    def recv(self, t: torch.Tensor, src: int, tag: int, what: str) -> None:
        box: list[BaseException] = []
        done = threading.Event()
        # inference mode is per thread: the receiving one writes `t` in the caller's mode
        self._jobs.put(((t, src, tag, what), torch.is_inference_mode_enabled(), box, done))
        while not done.wait(WATCH_SLICE_S):
            if gone := known_lost(self._others):
                raise lost_error(gone[0], what)
        if box:
            raise box[0]

    def close(self) -> None:
        """No more receives (one still posted ends with the channel)."""
        self._jobs.put(None)

    __del__ = close


def _receive_jobs(link: Channel, jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        args, inference, box, done = job
        try:
            with torch.inference_mode(inference):
                link.recv_tensor(*args)
        except BaseException as exc:  # noqa: BLE001 (raised by the waiting caller)
            box.append(exc)
        done.set()


class RecvWorker:
    """One thread that runs receive loops one after another, in the order given: receivers of
    later rounds from the same source (whose chunks it queues after an earlier round's) share
    it, so a prefetch's rounds take one thread per source however many steps it spans."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name=name).start()

    def submit(self, fn: Callable, *args) -> threading.Event:
        """`fn(*args)` once every earlier job ended; the event is set when it has."""
        done = threading.Event()
        self._jobs.put((fn, args, done))
        return done

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, done = job
            try:
                fn(*args)
            finally:
                done.set()

    def close(self) -> None:
        """No more jobs: the thread ends after those given (one blocked in a receive ends
        with the channel)."""
        self._jobs.put(None)


class KvReceiver:
    """Receives every transfer addressed to member `me`; one thread per source (or, with
    `workers`, a job on that source's `RecvWorker`)."""

    def __init__(self, ranks: Sequence[int], me: int, transfers: Sequence[KvTransfer],
                 chunk_blocks: int, epoch: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, stats: ExchangeStats, *, link: Channel,
                 seq_base: int = 0, workers: Mapping[int, RecvWorker] | None = None) -> None:
        """`block_shape`: one layer of one block, (2, block_size, Hkv, D); `link`: the group's
        channel the chunks come over; `seq_base`: as `send_transfers`'; `workers`: source
        index -> the worker whose thread receives from it (None: a thread of its own)."""
        self._link = link
        self._shape, self._dtype = block_shape, dtype
        self._others = [r for r in link.ranks if r != link.rank]
        self._mine = [t for t in transfers if t.dst == me]
        self.staging = {id(t): torch.empty((t.blocks, len(t.layers), *block_shape), dtype=dtype)
                        for t in self._mine}
        self._pending: dict[int, int] = {}
        for t in self._mine:
            self._pending[t.request_id] = self._pending.get(t.request_id, 0) + 1
        self._cond = threading.Condition()
        self._arrived: list[int] = [r for r, n in self._pending.items() if n == 0]
        self._error: Exception | None = None
        """What ended a receiving thread (a member lost, or any other failure): every wait for
        a request still pending raises it (a thread that died silently left them waiting)."""
        self.stats = stats
        self._began = time.perf_counter()
        loops = {src: (ranks[src], pair_chunks(transfers, src, me, chunk_blocks), epoch,
                       seq_base) for src in self.sources}
        self._threads = [] if workers is not None else [
            threading.Thread(target=self._loop, args=args, daemon=True,
                             name=f"shunter-kv-recv-{src}") for src, args in loops.items()]
        self._jobs = [] if workers is None else [
            workers[src].submit(self._loop, *args) for src, args in loops.items()]
        for th in self._threads:
            th.start()

    def _loop(self, rank: int, chunks: list[tuple[KvTransfer, int, int]], epoch: int,
              seq_base: int) -> None:
        left: dict[int, int] = {}
        for t, _, _ in chunks:
            left[id(t)] = left.get(id(t), 0) + 1
        for seq, (t, lo, hi) in enumerate(chunks):
            with self._cond:  # (a dropped request's chunk: into a tensor let go at once)
                kept = self.staging.get(id(t))
                dst = kept[lo:hi] if kept is not None else torch.empty(
                    (hi - lo, len(t.layers), *self._shape), dtype=self._dtype)
            try:
                self._link.recv_tensor(dst, rank, _tag(epoch, seq_base + seq),
                                       "its KV was being exchanged")
            except Exception as exc:  # noqa: BLE001 (raised by every wait: none waits forever)
                with self._cond:
                    self._error = exc if isinstance(exc, GroupMemberLost) else RuntimeError(
                        f"receiving KV chunk {seq} of {len(chunks)} from instance {rank} "
                        f"failed: {type(exc).__name__}: {exc}")
                    self._cond.notify_all()
                return
            with self._cond:
                self.stats.add_received(dst.numel() * dst.element_size())
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
                if not self._cond.wait(WATCH_SLICE_S) and (gone := known_lost(self._others)):
                    self._error = lost_error(gone[0], "its KV was being exchanged")
            if self._pending.get(request_id, 0):
                raise self._error
            self._pending.pop(request_id, None)
        return [(t, self.staging.pop(id(t))) for t in self._mine
                if t.request_id == request_id and id(t) in self.staging]

    def drop(self, request_id: int) -> None:
        """Its chunks are not wanted: what came is let go, what comes is not kept."""
        with self._cond:
            for t in self._mine:
                if t.request_id == request_id:
                    self.staging.pop(id(t), None)

    @property
    def own_threads(self) -> int:
        """Threads it started (none with `workers`)."""
        return len(self._threads)

    def staged_bytes(self) -> int:
        """Host bytes its staging tensors hold (received, or allocated for chunks to come)."""
        with self._cond:
            return sum(x.numel() * x.element_size() for x in self.staging.values())

    def take_arrived(self) -> list[int]:
        """Requests complete here since the last call."""
        with self._cond:
            out, self._arrived = self._arrived, []
        return out

    def pending(self) -> set[int]:
        with self._cond:
            return {r for r, n in self._pending.items() if n}

    @property
    def sources(self) -> list[int]:
        """Member indices it receives from."""
        return sorted({t.src for t in self._mine})

    def join(self, timeout: float | None = None) -> bool:
        """Whether every receive loop ended (False: `timeout` seconds passed first, for each
        in turn); raises what ended one."""
        for th in self._threads:
            th.join(timeout)
        ended = (not any(th.is_alive() for th in self._threads)
                 and all(done.wait(timeout) for done in self._jobs))
        if self._error is not None:
            raise self._error
        return ended
