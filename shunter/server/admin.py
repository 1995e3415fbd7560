"""Admin routes: the running policy read, replaced and rolled back over HTTP, and what the REPL's
`status` shows as JSON. Loopback clients may use them freely when no API key is set; otherwise
the key must be given (`Authorization: Bearer KEY`), and without a key set a client from another
host is refused (403).

    GET  /admin/policy            name, version, source, file, classes, explanation, last diff
    PUT  /admin/policy            policy text (?filename= names it in errors): 200 with the diff
                                  and the new version, or 400 with every error as FILE:LINE:COL
    POST /admin/policy/rollback   back to the previous policy (a new version); 409 if none
    GET  /admin/stats             queues, preemptions, overload triggers; TTFT/TPOT and SLO
                                  attainment per class since the running policy was loaded
"""

from __future__ import annotations

import hmac
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.errors import PolicyError, ShunterError
from engine.outputs import GenerationChunk
from engine.params import SchedulingParams
from engine.timeline import RequestTimeline
from policies import policy_dir
from policy_lang.api import compile_policy
from shunter.engine import Engine
from shunter.policy_control import PolicyChange, PolicyControl
from shunter.status import Status, class_stats

LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
MAX_POLICY_BYTES = 1 << 20
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          409: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}


def error(status: int, code: str, message: str, **extra: object) -> JSONResponse:
    """OpenAI's error object (`extra` adds fields beside it, e.g. the list of policy errors)."""
    body = {"error": {"message": message, "type": _TYPES[status], "param": None, "code": code}}
    return JSONResponse({**body, **extra}, status_code=status)


class FinishedRequests:
    """The latest finished requests' timelines, each with the policy version it finished under
    (the server core's `on_finished` feeds it; `/admin/stats` reads it)."""

    def __init__(self, engine: Engine, keep: int = 5000) -> None:
        self.engine = engine
        self._done: deque[tuple[int, RequestTimeline]] = deque(maxlen=keep)

    def on_finished(self, chunk: GenerationChunk | None, finish_reason: str,
                    scheduling: SchedulingParams) -> None:
        if chunk is not None and chunk.timeline is not None:
            self._done.append((self.engine.policy_version, chunk.timeline))

    def since(self, version: int) -> list[RequestTimeline]:
        return [t for v, t in self._done if v == version]


class Admin:
    def __init__(self, engine: Engine, *, api_key: str | None,
                 finished: FinishedRequests | None = None) -> None:
        self.engine = engine
        self.api_key = api_key
        self.control = PolicyControl(engine)
        self.finished = finished or FinishedRequests(engine)

    def routes(self) -> list[Route]:
        return [self._route("/admin/policy", self.get_policy, "GET"),
                self._route("/admin/policy", self.put_policy, "PUT"),
                self._route("/admin/policy/rollback", self.rollback, "POST"),
                self._route("/admin/stats", self.stats, "GET")]

    def _route(self, path: str, handler: Callable[[Request], Awaitable[Response]],
               method: str) -> Route:
        async def endpoint(request: Request) -> Response:
            refused = self.refusal(request)
            if refused is not None:
                return refused
            try:
                return await handler(request)
            except ShunterError as exc:  # the engine has stopped
                return error(503, "engine_dead", str(exc))
        return Route(path, endpoint, methods=[method])

    def refusal(self, request: Request) -> Response | None:
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if self.api_key is not None:
            if hmac.compare_digest(token.encode(), self.api_key.encode()):
                return None
            return error(401, "unauthorized", "a valid API key is needed: "
                         "send 'Authorization: Bearer KEY'")
        host = request.client.host if request.client is not None else None
        if host in LOOPBACK:
            return None
        return error(403, "forbidden", f"the admin routes answer loopback clients only (this "
                     f"request came from {host}); start the server with --api-key to allow others")

    # ------------------------------------------------------------------------ routes

    async def get_policy(self, _: Request) -> Response:
        p = self.engine.policy
        explain = getattr(p, "explain", None)
        return JSONResponse({
            "name": p.settings.name, "version": self.engine.policy_version, "source": p.source,
            "filename": str(getattr(p, "filename", "")) or None,
            "classes": [c.name for c in p.settings.classes],
            "explain": explain().rstrip() if explain is not None else
            f"{p.settings.name} is a built-in Python policy",
            "last_diff": self.control.last_diff(),
            "previous_version": self.control.previous_version()})

    async def put_policy(self, request: Request) -> Response:
        body = b""
        async for part in request.stream():
            body += part
            if len(body) > MAX_POLICY_BYTES:
                return error(413, "body_too_large",
                             f"a policy has at most {MAX_POLICY_BYTES} bytes")
        try:
            text = body.decode()
        except UnicodeDecodeError as exc:
            return error(400, "invalid_request", f"the policy is not UTF-8 text: {exc}")
        filename = request.query_params.get("filename") or "<replacement>"
        running = self.engine.policy
        try:
            new = compile_policy(text, filename=filename,
                                 base_dir=Path(getattr(running, "base_dir", None) or policy_dir()),
                                 capabilities=self.engine.capabilities)
            change = await self.control.switch(new)
        except PolicyError as exc:
            return policy_refused(exc)
        return JSONResponse(change_json(change))

    async def rollback(self, _: Request) -> Response:
        change = await self.control.rollback()
        if change is None:
            return error(409, "no_previous_policy", "nothing to roll back to: the running policy "
                         "is the one the server started with")
        return JSONResponse(change_json(change))

    async def stats(self, _: Request) -> Response:
        if hasattr(self.engine, "instances"):  # a cluster: the stats of each instance
            from shunter.server.cluster_metrics import cluster_stats_json

            return JSONResponse(cluster_stats_json(await self.engine.inspect()))
        return JSONResponse((await self.status()).as_json())

    async def status(self) -> Status:
        snapshot = await self.engine.inspect()
        timelines = self.finished.since(self.engine.policy_version)
        labels = [c.name for c in self.engine.policy.settings.classes]
        labels += sorted({t.request_class for t in timelines} - set(labels))
        rows = tuple(class_stats(label, [t for t in timelines if t.request_class == label])
                     for label in labels)
        return Status(scheduler=snapshot.scheduler, running_s=self.control.running_s(),
                      classes=rows)


def change_json(change: PolicyChange) -> dict:
    return {"name": change.new.settings.name, "version": change.version,
            "previous": change.old.settings.name, "previous_version": change.old_version,
            "restored": change.restored, "diff": change.diff}


def policy_refused(exc: PolicyError) -> JSONResponse:
    """400 with each error as a `FILE:LINE:COL: message` line; the running policy stays."""
    diagnostics = getattr(exc, "diagnostics", ())
    lines = [f"{d.span}: {d.message}" for d in diagnostics] or [str(exc).splitlines()[0]]
    return error(400, "policy_error", "\n".join(lines), errors=lines, detail=str(exc))
