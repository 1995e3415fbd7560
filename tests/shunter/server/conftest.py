"""Real servers on 127.0.0.1 for the HTTP tests.

`serving(...)` runs an engine and a Hypercorn server in the test's own event loop (for servers a
test changes: an API key, a drain, a dead engine). `ServerThread` runs one in a thread with its
own loop, so one server per module and async backend serves many tests."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Sequence

import anyio
import attrs
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from policies import policy_dir
from shunter import Engine, EngineConfig
from shunter.server import ServerSettings, build_app
from shunter.server.serve import serve_app
from tests.http_serving import serving_app


async def _inspect(request: Request) -> JSONResponse:
    """Test-only: the engine's queues and blocks, waiting until idle if `?idle=1`."""
    engine: Engine = request.app.state.engine
    if request.query_params.get("idle"):
        with anyio.fail_after(20):
            snap = await engine.wait_idle()
    else:
        snap = await engine.inspect()
    return JSONResponse({"idle": snap.idle, "allocated": snap.allocator.allocated_blocks,
                         "live": len(snap.scheduler.live_requests),
                         "free": snap.allocator.free_blocks})


TEST_ROUTES = (Route("/test/inspect", _inspect),)


@attrs.define
class Served:
    url: str
    app: Starlette
    engine: Engine


@contextlib.asynccontextmanager
async def serving(config: EngineConfig, settings: ServerSettings | None = None, *,
                  backend: object = None, extra_routes: Sequence = ()) -> AsyncIterator[Served]:
    async with Engine.start(config, backend=backend) as engine:
        app = build_app(engine, settings, extra_routes=(*TEST_ROUTES, *extra_routes))
        async with serving_app(app) as url:
            yield Served(url=url, app=app, engine=engine)


class ServerThread:
    """A server on its own thread and event loop (`backend`: asyncio or trio)."""

    def __init__(self, config: EngineConfig, settings: ServerSettings | None, backend: str, *,
                 engine_backend: object = None) -> None:
        self._config, self._settings, self._backend = config, settings, backend
        self._engine_backend = engine_backend
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.url = ""
        self.finished: list[tuple[str, object]] = []
        """(finish reason, scheduling params) of every request, from `app.state.on_finished`."""
        self._thread = threading.Thread(target=self._main, daemon=True,
                                        name=f"server-{backend}")

    def start(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(120)
        if self._error is not None or not self.url:
            raise RuntimeError(f"the test server did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _main(self) -> None:
        try:
            anyio.run(self._serve, backend=self._backend)
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        async def stopped() -> None:
            while not self._stop.is_set():
                await anyio.sleep(0.05)

        async with Engine.start(self._config, backend=self._engine_backend) as engine:
            app = build_app(engine, self._settings, extra_routes=TEST_ROUTES)
            app.state.on_finished.append(
                lambda chunk, reason, scheduling: self.finished.append((reason, scheduling)))
            async with anyio.create_task_group() as tg:
                self.url = await tg.start(
                    lambda task_status: serve_app(app, shutdown_trigger=stopped,
                                                  task_status=task_status))
                self._ready.set()


class Servers:
    """One server per async backend, started when a test first asks for it."""

    def __init__(self, config: EngineConfig, settings: ServerSettings | None = None) -> None:
        self._config, self._settings = config, settings
        self._running: dict[str, ServerThread] = {}

    def url(self, backend: str) -> str:
        return self.thread(backend).url

    def thread(self, backend: str) -> ServerThread:
        if backend not in self._running:
            self._running[backend] = ServerThread(self._config, self._settings, backend).start()
        return self._running[backend]

    def stop(self) -> None:
        for server in self._running.values():
            server.stop()


def tiny_config(model_dir, **overrides) -> EngineConfig:
    fields = dict(model=model_dir, device="cpu", dtype="float32", num_blocks=64, block_size=4,
                  max_num_seqs=8, max_batched_tokens=64)
    fields.update(overrides)
    return EngineConfig(**fields)


CHAT_TEMPLATE = """{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}
{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.fixture(scope="module")
def tiny_servers(tiny_llama_dir, tmp_path_factory):
    """Tiny Llama servers (random weights) under a policy with rt and be classes."""
    template = tmp_path_factory.mktemp("chat") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    config = tiny_config(tiny_llama_dir, policy=policy_dir() / "round_robin_rtbe.policy")
    servers = Servers(config, ServerSettings(served_model_name="tiny", chat_template=template))
    yield servers
    servers.stop()
