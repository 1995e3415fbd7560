"""Finding an instance that went silent: its host cut off the network or powered down, or its
process stopped, so its control link neither carries messages nor closes (no FIN ever comes).

The front door's handle sends `Ping` on the control link every `Liveness.interval_s`; the
instance answers `Pong` from the task that reads its link (shunter/cluster/instance.py), never
from its device thread, so a long step does not delay the answer. Any message from the instance
counts as heard. Once nothing was heard for `Liveness.silent_after_s`, the handle declares the
instance lost and treats it as a dead one (shunter/cluster/handles.py): streamed requests end
with an error naming the instance and that it went silent, unstreamed ones are dispatched
again, its groups are handled as a lost head's or member's, and its process is killed where the
front door can reach it (so an instance that comes back cannot serve twice).

The other way (`Liveness.front_door_silent_after_s`, off by default): the pings carry that bound
(`TimedPing`), and the instance counts its front door silent once nothing at all was heard from
it for that long (`FrontDoorWatch`): its host cut off or down, or its process stopped. The
instance then ends what it holds as when its link closes (shunter/cluster/instance.py): every request cancelled
(its blocks freed), the process ended, so a group it leads or serves in loses it at once (the
data plane's watch sees its connections close) and the others serve alone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import attrs

from engine.errors import ConfigError
from shunter.cluster.wire import Ping


@attrs.frozen(kw_only=True)
class TimedPing(Ping):
    """A `Ping` that carries `Liveness.front_door_silent_after_s` to the instance
    (`FrontDoorWatch`): it counts its front door silent once nothing was heard for that long."""

    silent_after_s: float | None = None


@attrs.frozen(kw_only=True)
class Liveness:
    """How the front door finds a silent instance (`Cluster.start(liveness=...)`)."""

    interval_s: float = 0.25
    """A `Ping` this often."""
    silent_after_s: float | None = 5.0
    """Lost once nothing was heard for this long (`None`: never; only a closed link or a dead
    process is found). The default holds a wide margin over what a live instance under load
    was measured to take (README, "Cluster")."""
    front_door_silent_after_s: float | None = None
    """Each instance ends what it holds once nothing was heard from the front door for this long
    (its pings carry it: `TimedPing`); None: never. Off by default: an instance cannot tell a
    front door that is gone from one whose own loop is blocked (a test computing references
    synchronously inside a running cluster blocks it for seconds), so the value must exceed the
    longest such stall."""

    def __attrs_post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ConfigError(f"Liveness.interval_s must be > 0, got {self.interval_s}")
        for name in ("silent_after_s", "front_door_silent_after_s"):
            value = getattr(self, name)
            if value is not None and not value > 2 * self.interval_s:
                raise ConfigError(
                    f"Liveness.{name} ({value}) must be more than twice interval_s "
                    f"({self.interval_s}), else one late message would end a live peer")


class Heartbeat:
    """One handle's watch: `heard()` on every message; `run` pings and calls `on_silent` once,
    with the reason, when a ping stayed unanswered (nothing at all heard since it was sent) for
    `silent_after_s`. Counted from the ping, not from the last message: a front door that was
    itself stalled sent no pings meanwhile and does not blame the instance for its silence."""

    def __init__(self, index: int, liveness: Liveness, ping: Callable[[int], Awaitable[None]],
                 on_silent: Callable[[str], None]) -> None:
        self.index = index
        self.liveness = liveness
        self._ping = ping
        self._on_silent = on_silent
        self._waiting_since: float | None = None
        """When the first ping not yet followed by any message was sent."""
        self.longest_wait_s = 0.0
        """The longest a ping waited for the next message (the margin the default must keep)."""
        self.longest_answer_s = 0.0
        """The longest a `Pong` took to come back (the instance's own answering time)."""
        self._sent: dict[int, float] = {}
        self.pings = 0
        self._pinging = False

    def answered(self, seq: int) -> None:
        sent = self._sent.pop(seq, None)
        if sent is not None:
            self.longest_answer_s = max(self.longest_answer_s, anyio.current_time() - sent)
        for old in [k for k in self._sent if k < seq]:  # answered out of order: never
            del self._sent[old]

    def heard(self) -> None:
        if self._waiting_since is not None:
            waited = anyio.current_time() - self._waiting_since
            self.longest_wait_s = max(self.longest_wait_s, waited)
            self._waiting_since = None

    def silent_s(self) -> float:
        """How long the oldest unanswered ping has waited (0: none waits)."""
        since = self._waiting_since
        return 0.0 if since is None else anyio.current_time() - since

    async def run(self) -> None:
        live = self.liveness
        async with anyio.create_task_group() as tg:
            while True:
                await anyio.sleep(live.interval_s)
                if not self._pinging:  # a send that blocks (a full buffer) never stops the watch
                    tg.start_soon(self._send_ping)
                if live.silent_after_s is None or self.silent_s() < live.silent_after_s:
                    continue
                # let this process's reader take what already arrived (a front door stalled
                # right after a ping must not blame the instance for an answer it did not read)
                await anyio.sleep(min(live.interval_s, 0.05))
                silent = self.silent_s()
                if silent >= live.silent_after_s:
                    tg.cancel_scope.cancel()
                    self._on_silent(
                        f"instance {self.index} went silent: no answer to a ping for "
                        f"{silent:.1f} s (lost after {live.silent_after_s} s without an answer "
                        f"to pings every {live.interval_s} s; its host may be cut off or down)")
                    return

    def ping_message(self, seq: int) -> TimedPing:
        """The ping to send: it tells the instance this side's bound."""
        return TimedPing(seq=seq, silent_after_s=self.liveness.front_door_silent_after_s)

    async def _send_ping(self) -> None:
        self._pinging = True
        self.pings += 1
        now = anyio.current_time()
        self._sent[self.pings] = now
        if self._waiting_since is None:
            self._waiting_since = now
        try:
            await self._ping(self.pings)
        finally:
            self._pinging = False


class FrontDoorWatch:
    """The instance's watch on its front door: `heard` on every message from it. Armed by the
    first `TimedPing` that carries a bound (a front door that sends none is never judged), it
    calls `on_silent` once, with the reason, when nothing was heard for that bound. A second
    look a moment later lets this instance's reader take what already arrived, so an instance
    whose own loop was stalled does not blame its front door for messages it did not read."""

    def __init__(self) -> None:
        self.bound_s: float | None = None
        self._heard: float | None = None

    def heard(self, msg: object) -> None:
        self._heard = anyio.current_time()
        if isinstance(msg, TimedPing):
            self.bound_s = msg.silent_after_s

    def silent_s(self) -> float:
        return 0.0 if self._heard is None else anyio.current_time() - self._heard

    async def run(self, on_silent: Callable[[str], Awaitable[None]]) -> None:
        while True:
            bound = self.bound_s
            await anyio.sleep(0.25 if bound is None else min(0.25, bound / 4))
            if bound is None or self.silent_s() < bound:
                continue
            await anyio.sleep(0.05)
            silent = self.silent_s()
            if self.bound_s is not None and silent >= self.bound_s:
                await on_silent(
                    f"the front door went silent: nothing heard from it for {silent:.1f} s "
                    f"(its pings stopped; the bound it sent is {self.bound_s} s); "
                    f"its host may be cut off or down")
                return
