"""An app served over real HTTP (hypercorn on a free local port) for as long as a test needs it,
by the engine tests' servers and the cluster's."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio

from shunter.server.serve import serve_app


@contextlib.asynccontextmanager
async def serving_app(app) -> AsyncIterator[str]:
    """The app's base URL while the block runs; the server stops when it ends."""
    done = anyio.Event()  # hypercorn stops by its trigger, not by cancellation
    async with anyio.create_task_group() as tg:
        url = await tg.start(lambda task_status: serve_app(
            app, shutdown_trigger=done.wait, task_status=task_status))
        try:
            yield url
        finally:
            done.set()
