"""KunServe's KV exchange on the simulated network (§4.2), in virtual time.

When instances form a group, each source instance sends the KV of its requests for the layers
other members now keep, over its own link (`sim/network.py`); the group's pipeline sends its
activations over the same links. Two disciplines, the policy's `kv_exchange` setting:
- `fifo`: the KV goes as one queue; an activation sent while it drains waits behind all of it
  (the stall §5.3 measures without coordination).
- `coordinated`: the KV goes in chunks; an activation waits at most for the chunk on the wire,
  and the time it takes on the link delays the KV behind it.
Either way a request is told its KV has arrived (the head scheduler's `SwapDone`) when its own
last byte lands: requests wait only for their own chunks, in the order they are queued.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import anyio

from sim.network import NetworkLink

CHUNK_BYTES = 16 * 2**20
"""A coordinated exchange's chunk: 2.1 ms on a100-internode (7.83 GB/s), about a decode stage
of Llama-3-8B over 2 stages (the profile's 9.7 ms step / 2 + per-sequence terms): §4.2 sizes a
chunk so it takes about as long as a stage."""


class SimExchange:
    """One source instance's outgoing KV during a group's formation (or restore)."""

    def __init__(self, link: NetworkLink, *, coordinated: bool,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self.link = link
        self.coordinated = coordinated
        self.chunk_bytes = chunk_bytes
        self.start = 0.0
        self.busy_until = 0.0
        """When the queued KV will have drained (moves later as activations cut in)."""
        self.sent_bytes = 0
        self.stolen_s = 0.0
        """Link time activations took while KV was queued (coordinated)."""
        self.stalled_s = 0.0
        """Time activations waited behind KV."""
        self._queue: deque[tuple[int, int]] | None = None

    def _send_s(self, nbytes: int) -> float:
        if not self.coordinated:
            return self.link.send_s(nbytes)
        full, rest = divmod(nbytes, self.chunk_bytes)
        return full * self.link.send_s(self.chunk_bytes) + self.link.send_s(rest)

    def activation_wait(self, now: float) -> float:
        """How long an activation sent at `now` waits for the link."""
        if now >= self.busy_until:
            return 0.0
        if not self.coordinated:
            wait = self.busy_until - now
        else:
            chunk_s = self.link.send_s(self.chunk_bytes)
            wait = min(self.busy_until - now, chunk_s - (now - self.start) % chunk_s)
        self.stalled_s += wait
        return wait

    def note_activations(self, now: float, seconds: float) -> None:
        """Activations took `seconds` of this link at `now`; queued chunks go after them."""
        if self.coordinated and now < self.busy_until:
            self.busy_until += seconds
            self.stolen_s += seconds

    async def run(self, queue: Sequence[tuple[int, int]],
                  arrived: Callable[[int], Awaitable[None]]) -> None:
        """Send (request id, bytes) in order; `arrived(id)` once each request's last byte lands.
        `add` queues more behind them while this runs."""
        self.start = anyio.current_time()
        self._queue = deque(queue)
        self.busy_until = self.start + sum(self._send_s(b) for _, b in queue)
        while self._queue:
            rid, nbytes = self._queue.popleft()
            stolen = self.stolen_s
            await anyio.sleep(self._send_s(nbytes))
            while self.stolen_s > stolen:  # activations went first: the chunks come later
                extra, stolen = self.stolen_s - stolen, self.stolen_s
                await anyio.sleep(extra)
            self.sent_bytes += nbytes
            await arrived(rid)
        self._queue = None
        self.busy_until = min(self.busy_until, anyio.current_time())

    def add(self, rid: int, nbytes: int) -> bool:
        """Queue (rid, bytes) behind what `run` still sends; False when it has ended."""
        if self._queue is None:
            return False
        self._queue.append((rid, nbytes))
        self.busy_until = max(self.busy_until, anyio.current_time()) + self._send_s(nbytes)
        return True


def group_wait(exchanges: Sequence[SimExchange], now: float) -> float:
    """An activation crossing the group's links waits for the slowest of them."""
    return max((x.activation_wait(now) for x in exchanges), default=0.0)
