"""Per-app state: the engine, the settings, live requests, draining, and end-of-request hooks."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import attrs

from engine.outputs import GenerationChunk
from engine.params import SchedulingParams
from shunter.engine import Engine
from shunter.server.chat import ChatTemplate
from shunter.server.settings import ServerSettings

FinishedHook = Callable[[GenerationChunk | None, str, SchedulingParams], None]
"""Told once per admitted request when it ends: its final chunk (None if the client went away
or the server shut down first), the finish reason (`stop`, `length`, `cancelled`, `error`) and
its scheduling params."""


@attrs.define(eq=False)
class ServerState:
    engine: Engine
    settings: ServerSettings
    model_name: str
    chat_template: ChatTemplate | None
    on_finished: list[FinishedHook] = attrs.field(factory=list)
    draining: str | None = None
    """Why new requests are refused (the server is shutting down), or None while serving."""
    live: int = 0
    """Generation requests being answered."""
    _shutdown: anyio.Event | None = None
    _idle: anyio.Event | None = None

    @property
    def shutdown(self) -> anyio.Event:
        """Set when the drain deadline passes: live requests end at once."""
        if self._shutdown is None:
            self._shutdown = anyio.Event()
        return self._shutdown

    def unavailable(self) -> str | None:
        """Why the server cannot take a request now, or None."""
        return self.engine.failure or self.draining

    def finished(self, chunk: GenerationChunk | None, reason: str,
                 scheduling: SchedulingParams) -> None:
        for hook in self.on_finished:
            hook(chunk, reason, scheduling)

    def enter(self) -> None:
        self.live += 1

    def leave(self) -> None:
        self.live -= 1
        if self.live == 0 and self._idle is not None:
            self._idle.set()

    async def drain(self, timeout_s: float, reason: str = "the server is shutting down") -> int:
        """Refuse new requests, wait up to `timeout_s` for live ones to finish, then end the
        rest; returns how many were cut short."""
        self.draining = reason
        with anyio.move_on_after(timeout_s):
            await self._wait_idle()
        cut = self.live
        self.shutdown.set()
        with anyio.move_on_after(5.0):
            await self._wait_idle()
        return cut

    async def _wait_idle(self) -> None:
        while self.live:
            self._idle = anyio.Event()
            await self._idle.wait()
