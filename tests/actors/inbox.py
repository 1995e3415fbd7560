"""Helpers for actor tests on trio's virtual clock."""

from __future__ import annotations

from typing import TypeVar

import anyio
import trio
from anyio.streams.memory import MemoryObjectReceiveStream

T = TypeVar("T")


async def receive(stream: MemoryObjectReceiveStream[T], within_s: float = 60.0) -> T:
    """The next message, or TooSlowError once `within_s` virtual seconds pass without one
    (under `autojump_clock` at once), so that a message that never comes fails the test
    instead of hanging it."""
    with trio.fail_after(within_s):
        return await stream.receive()


def nothing_waiting(stream: MemoryObjectReceiveStream[object]) -> bool:
    try:
        stream.receive_nowait()
    except anyio.WouldBlock:
        return True
    return False
