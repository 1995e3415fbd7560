"""Serving an app with Hypercorn under asyncio or trio, and shutting down gracefully.

    async with anyio.create_task_group() as tg:
        url = await tg.start(serve_app, app, "127.0.0.1", 0)   # port 0: any free port
        ...
        tg.cancel_scope.cancel()

`serve_app` binds the socket itself, so the caller learns the port before the first request.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Awaitable, Callable

import anyio
import sniffio
from hypercorn.config import Config
from starlette.applications import Starlette

from shunter.server.state import ServerState


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve_app(app: Starlette, host: str = "127.0.0.1", port: int = 0, *,
                    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                    task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve until `shutdown_trigger` returns (or forever); reports the URL when listening."""
    sock = bind(host, port)
    url = url_of(sock)
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 3.0
    config.backlog = 2048  # hypercorn's 100 resets connections in a burst of clients
    config.keep_alive_timeout = 75.0
    trigger = shutdown_trigger or anyio.sleep_forever
    task_status.started(url)
    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve
    else:
        from hypercorn.asyncio import serve
    await serve(app, config, shutdown_trigger=trigger)  # type: ignore[arg-type]


async def drain_on_signal(state: ServerState, drain_timeout_s: float,
                          say: Callable[[str], None] = print) -> None:
    """Return once SIGINT or SIGTERM came and the live requests finished (or were cut short
    after `drain_timeout_s`); new requests get 503 meanwhile."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            break
    say(f"{signal.Signals(signum).name}: draining {state.live} requests "
        f"(up to {drain_timeout_s:g} s)")
    cut = await state.drain(drain_timeout_s)
    if cut:
        say(f"cancelled {cut} requests still running at the drain deadline")
