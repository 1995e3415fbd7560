"""A one-shot answer channel, for the few messages that need an answer (inspection, policy swap)."""

from __future__ import annotations

from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class Reply(Generic[T]):
    """Created by the asker inside the event loop; the receiving actor calls `send` once."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    def send(self, value: T) -> None:
        self._value = value
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def wait(self) -> T:
        await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
