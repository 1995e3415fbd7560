"""Moving KV blocks between the device arena and a host swap space (FastSwitch §3.2).

Worker threads dispatch the copies of each swap ticket; on CUDA they run on a dedicated copy
stream from pinned host memory and record an event, and every `yield_every` copies a worker waits
for the stream to drain so the inference stream's own copies are not queued behind thousands of
ours. On the CPU the same code does real copies between two host buffers in the worker threads.

Granularity (the comparison FastSwitch makes):
- `per-block`: vLLM 0.3.3's swap, one copy per block per layer per K/V (2 * layers calls a block);
- `groups`: one copy per run of consecutive block ids on both sides (the arena is block-major, so
  such a run is one contiguous byte range).

Conflicts: a ticket records every device and host block it touches. A later ticket touching one
of them waits for exactly the earlier tickets involved; a step that is about to write a block
waits (`wait_blocks`) for exactly the tickets still using it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import attrs
import torch

from engine.iteration_log import SwapCounters
from engine.memory.block_groups import coalesce
from engine.messages import SwapDirection as Direction
from engine.policy import SwapGranularity as Granularity
from engine.memory.slot_runs import slot_blocks
from gpu.slot_copy import copy_slots

__all__ = ["SwapStats", "TorchSwapper", "coalesce"]



@attrs.frozen(kw_only=True)
class SwapStats:
    copy_calls: int
    copy_calls_in: int
    """Of `copy_calls`, those host -> device."""
    bytes_out: int
    bytes_in: int
    yields: int
    conflict_waits: int


class _Ticket:
    __slots__ = ("id", "future", "event", "blocks")

    def __init__(self, ticket_id: int, blocks: tuple[list[int], list[int]]) -> None:
        self.id = ticket_id
        self.future: Future[None] = Future()
        self.event: torch.cuda.Event | None = None
        self.blocks = blocks

    def done(self) -> bool:
        if not self.future.done():
            return False
        return self.event is None or self.event.query()


class TorchSwapper:
    """Real copies between `device_kv` ([blocks, L, 2, bs, H, D]) and a host buffer like it."""

    def __init__(self, device_kv: torch.Tensor, num_host_blocks: int, *, workers: int = 2,
                 yield_every: int = 256) -> None:
        self.device_kv = device_kv
        cuda = device_kv.is_cuda
        self.host_kv = torch.zeros((num_host_blocks, *device_kv.shape[1:]), dtype=device_kv.dtype,
                                   pin_memory=cuda)
        self.block_nbytes = device_kv[0].numel() * device_kv.element_size()
        self._stream = torch.cuda.Stream(device=device_kv.device) if cuda else None
        # one intra-op thread each: a copy worker that entered OpenMP would start a second
        # thread pool and slow every step (gpu/device_thread.py)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shunter-swap",
                                        initializer=torch.set_num_threads, initargs=(1,))
        self._lock = threading.Lock()
        self._tickets: dict[int, _Ticket] = {}
        self._device_busy: dict[int, _Ticket] = {}
        self._host_busy: dict[int, _Ticket] = {}
        self._yield_every = yield_every
        self._since_yield = 0
        self._stats = dict(copy_calls=0, copy_calls_in=0, bytes_out=0, bytes_in=0, yields=0,
                           conflict_waits=0, runs=0)
        self._blocks = {"out": 0, "in": 0}
        self._slots = {"out": 0, "in": 0, "move": 0}
        """Slots copied by BROS's slot copies, per direction (`slot_counts`)."""
        self._failures: dict[int, str] = {}
        self._failed_ids: dict[int, str] = {}
        """Every ticket that failed (few), so a late `wait` for one still raises."""
        self._stall_s = 0.0

    # ---------------------------------------------------------------------------- dispatch

    def submit(self, ticket_id: int, direction: Direction, pairs: Sequence[tuple[int, int]],
               granularity: Granularity) -> None:
        """Queue the copies of one ticket; returns at once."""
        if granularity == "slots":  # BROS's slot copies (gpu/slot_copy.py)
            ticket = _Ticket(ticket_id, slot_blocks(direction, pairs, self.device_kv.shape[3]))
        else:
            ticket = _Ticket(ticket_id, ([g for g, _ in pairs], [c for _, c in pairs]))
        with self._lock:
            # sharing a device block only orders the copies; sharing a host block means this
            # ticket reads (or overwrites) what the other wrote, so it needs that one to succeed
            deps = {self._device_busy[g] for g in ticket.blocks[0] if g in self._device_busy}
            needs = {self._host_busy[c] for c in ticket.blocks[1] if c in self._host_busy}
            for g in ticket.blocks[0]:
                self._device_busy[g] = ticket
            for c in ticket.blocks[1]:
                self._host_busy[c] = ticket
            self._tickets[ticket_id] = ticket
        self._pool.submit(self._run, ticket, direction, list(pairs), granularity, deps - needs,
                          needs)

    def _run(self, ticket: _Ticket, direction: Direction, pairs: list[tuple[int, int]],
             granularity: Granularity, deps: set[_Ticket], needs: set[_Ticket]) -> None:
        try:
            # ordered after exactly the tickets sharing a block with this one
            for dep in deps:
                self._wait_done(dep)
            for dep in needs:
                self._wait_ticket(dep)
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self._copy(direction, pairs, granularity)
                    ticket.event = torch.cuda.Event()
                    ticket.event.record(self._stream)
            else:
                self._copy(direction, pairs, granularity)
            ticket.future.set_result(None)
        except BaseException as exc:  # surfaces in wait()/done() callers
            ticket.future.set_exception(exc)

    def _copy(self, direction: Direction, pairs: list[tuple[int, int]], granularity: Granularity) -> None:
        dev, host = self.device_kv, self.host_kv
        layers = dev.shape[1]
        calls = 0
        if granularity == "slots":
            calls, nbytes = copy_slots(direction, pairs, dev, host)
            with self._lock:
                self._stats["copy_calls"] += calls
                self._stats["copy_calls_in"] += calls if direction == "in" else 0
                self._stats["bytes_in" if direction == "in" else "bytes_out"] += nbytes
                self._slots[direction] += len(pairs)
            return
        if granularity == "per-block":
            for g, c in pairs:
                for layer in range(layers):
                    for kv in (0, 1):
                        src, dst = (dev[g, layer, kv], host[c, layer, kv]) if direction == "out" \
                            else (host[c, layer, kv], dev[g, layer, kv])
                        dst.copy_(src, non_blocking=True)
                        calls += 1
                        self._maybe_yield()
        else:
            for g, c, n in coalesce(pairs):
                src, dst = (dev[g:g + n], host[c:c + n]) if direction == "out" \
                    else (host[c:c + n], dev[g:g + n])
                dst.copy_(src, non_blocking=True)
                calls += 1
                self._maybe_yield()
        with self._lock:
            self._stats["copy_calls"] += calls
            self._stats["runs"] += len(coalesce(pairs))
            self._stats["copy_calls_in"] += calls if direction == "in" else 0
            self._stats["bytes_out" if direction == "out" else "bytes_in"] += len(pairs) * self.block_nbytes
            self._blocks[direction] += len(pairs)

    def _maybe_yield(self) -> None:
        """After `yield_every` dispatched copies, let the copy stream drain (FastSwitch §3.2)."""
        if self._stream is None:
            return
        self._since_yield += 1
        if self._since_yield >= self._yield_every:
            self._stream.synchronize()
            self._since_yield = 0
            with self._lock:
                self._stats["yields"] += 1

    # ---------------------------------------------------------------------------- completion

    def done(self, ticket_id: int) -> bool:
        t = self._tickets.get(ticket_id)
        return t is None or t.done()

    def poll(self) -> list[int]:
        """Tickets that finished since the last poll, failed ones included (forgotten
        afterwards); `take_failures` says which failed and why."""
        with self._lock:
            finished = [t for t in self._tickets.values() if t.done()]
            for t in finished:
                del self._tickets[t.id]
                self._forget(t)
                exc = t.future.exception()
                if exc is not None:
                    self._failures[t.id] = self._failed_ids[t.id] = f"{type(exc).__name__}: {exc}"
        return [t.id for t in finished]

    def take_failures(self) -> dict[int, str]:
        """Tickets whose copies raised, with the error, since the last call."""
        with self._lock:
            failures, self._failures = self._failures, {}
        return failures

    def _forget(self, t: _Ticket) -> None:
        for g in t.blocks[0]:
            if self._device_busy.get(g) is t:
                del self._device_busy[g]
        for c in t.blocks[1]:
            if self._host_busy.get(c) is t:
                del self._host_busy[c]

    def _wait_ticket(self, t: _Ticket) -> None:
        """Until `t` has copied; raises if its copies failed."""
        t.future.result()
        if t.event is not None:
            t.event.synchronize()

    def _wait_done(self, t: _Ticket) -> None:
        """Until `t` is over, whether its copies succeeded or not."""
        if t.future.exception() is None and t.event is not None:
            t.event.synchronize()

    def wait(self, ticket_ids: Iterable[int]) -> None:
        """Before a step: order it after these tickets' copies (synchronous swap-ins, BROS's
        checkpoints and swap-backs); raises if one failed, even one already polled. The host
        waits only until each ticket's copies are dispatched (on the CPU: done); on CUDA the
        compute stream then waits on the ticket's event, the host does not (BROS §5.2: the
        swaps "conducted asynchronously"), as in `wait_blocks`."""
        for tid in ticket_ids:
            t = self._tickets.get(tid)
            if t is not None:
                t.future.result()
                if t.event is not None:
                    torch.cuda.current_stream(self.device_kv.device).wait_event(t.event)
            elif tid in self._failed_ids:
                raise RuntimeError(f"swap ticket {tid} failed: {self._failed_ids[tid]}")

    def wait_blocks(self, device_blocks: Iterable[int]) -> int:
        """Before a step writes these device blocks: wait for exactly the tickets still using
        them. On CUDA the compute stream waits on their events, the host does not. Returns how
        many tickets were waited for."""
        with self._lock:
            involved = {self._device_busy[g] for g in device_blocks if g in self._device_busy}
        involved = {t for t in involved if not t.done()}
        if not involved:
            return 0
        for t in involved:
            # dispatched (on the CPU: copied); a failed copy no longer uses the block, and its
            # failure reaches the requests it was moving through `take_failures`
            if t.future.exception() is None and t.event is not None:
                torch.cuda.current_stream(self.device_kv.device).wait_event(t.event)
        with self._lock:
            self._stats["conflict_waits"] += len(involved)
        return len(involved)

    def slot_counts(self) -> dict[str, int]:
        """Slots copied by slot copies so far: checkpoints and swap-outs (`out`), swapped back
        (`in`), merged into fresh blocks (`move`)."""
        with self._lock:
            return dict(self._slots)

    def stats(self) -> SwapStats:
        with self._lock:
            return SwapStats(**{k: v for k, v in self._stats.items() if k != "runs"})

    def next_poll_s(self) -> float | None:
        """How soon the swap pool should poll again: soon while tickets are pending."""
        return 0.001 if self._tickets else None

    def add_stall(self, seconds: float) -> None:
        with self._lock:
            self._stall_s += seconds

    def counters(self) -> SwapCounters:
        """Traffic so far, in the benchmark's terms."""
        with self._lock:
            s = self._stats
            return SwapCounters(copy_ops=s["copy_calls"], copy_ops_in=s["copy_calls_in"],
                                bytes_out=s["bytes_out"],
                                bytes_in=s["bytes_in"], blocks_out=self._blocks["out"],
                                blocks_in=self._blocks["in"], stall_s=self._stall_s,
                                runs=s["runs"], yields=s["yields"])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
