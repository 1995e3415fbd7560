"""What the REPL's commands drive, behind one protocol: an engine in this process (`Local`, with
its background workload) or a running server's admin API over HTTP (`Remote`, `--connect`)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Protocol

import anyio.from_thread
import attrs
import httpx

from engine.errors import PolicyCheckError, ShunterError
from engine.policy import Policy
from policies import policy_dir
from policy_lang.diagnostics import Diagnostic, Span
from policy_lang.api import compile_policy, load_policy_file
from shunter.policy_control import PolicyChange, PolicyControl
from shunter.repl.workload import Workload
from shunter.status import Status, class_stats


@attrs.frozen(kw_only=True)
class RunningPolicy:
    name: str
    version: int
    source: str
    filename: str | None
    classes: tuple[str, ...]


@attrs.frozen(kw_only=True)
class Switched:
    old: str
    new: str
    version: int
    """The version `new` runs as."""
    old_version: int
    diff: str
    restored: int | None = None
    """A rollback: the version that ran `new` before."""


class SessionBackend(Protocol):
    workload: Workload | None
    """The background workload (in-process only)."""

    def policy(self) -> RunningPolicy: ...

    def explain(self) -> str: ...

    def status(self) -> Status: ...

    def load(self, path: Path) -> Switched:
        """Run the policy file `path`; raises PolicyError and changes nothing if it cannot."""

    def replace(self, source: str, filename: str) -> Switched:
        """Run policy text (an edit of the running one); `filename` names it in errors."""

    def rollback(self) -> Switched | None: ...

    def last_diff(self) -> tuple[int, str] | None:
        """The version the running policy replaced, and the diff from it; None when the
        running policy replaced none."""


def _switched(change: PolicyChange) -> Switched:
    return Switched(old=change.old.settings.name, new=change.new.settings.name,
                    version=change.version, old_version=change.old_version, diff=change.diff,
                    restored=change.restored)


class Local:
    """An engine in this process, reached through a blocking portal to its event loop."""

    def __init__(self, portal: anyio.from_thread.BlockingPortal, engine: Any,
                 workload: Workload) -> None:
        self._portal = portal
        self.engine = engine
        self.workload: Workload | None = workload
        self.control = PolicyControl(engine)

    def policy(self) -> RunningPolicy:
        p = self.engine.policy
        return RunningPolicy(name=p.settings.name, version=self.engine.policy_version,
                             source=p.source, filename=_filename(p),
                             classes=tuple(c.name for c in p.settings.classes))

    def explain(self) -> str:
        explain = getattr(self.engine.policy, "explain", None)
        if explain is None:
            return f"{self.engine.policy.settings.name} is a built-in Python policy"
        return explain().rstrip()

    def status(self) -> Status:
        snapshot = self._portal.call(self.engine.inspect)
        w = self.workload
        finished = self._portal.call(lambda: list(w.finished))
        current = [f for f in finished if f.epoch == w.epoch]
        rows = tuple(class_stats(label, [f.timeline for f in current if f.label == label])
                     for label in ("rt", "be"))
        return Status(scheduler=snapshot.scheduler, running_s=self.control.running_s(),
                      classes=rows)

    def load(self, path: Path) -> Switched:
        return self._switch(load_policy_file(path, capabilities=self.engine.capabilities))

    def replace(self, source: str, filename: str) -> Switched:
        current = self.engine.policy
        new = compile_policy(source, filename=filename,
                             base_dir=getattr(current, "base_dir", None) or policy_dir(),
                             capabilities=self.engine.capabilities)
        return self._switch(new)

    def rollback(self) -> Switched | None:
        change = self._portal.call(self.control.rollback)
        if change is None:
            return None
        self.workload.epoch += 1
        return _switched(change)

    def last_diff(self) -> tuple[int, str] | None:
        diff, version = self.control.last_diff(), self.control.previous_version()
        return None if diff is None or version is None else (version, diff)

    def _switch(self, new: Policy) -> Switched:
        change = self._portal.call(functools.partial(self.control.switch, new))
        self.workload.epoch += 1
        return _switched(change)


def _filename(p: Policy) -> str | None:
    filename = getattr(p, "filename", None)
    return None if filename is None else str(filename)


def _remote_switched(change: dict) -> Switched:
    return Switched(old=change["previous"], new=change["name"], version=change["version"],
                    old_version=change.get("previous_version") or change["version"] - 1,
                    diff=change["diff"], restored=change.get("restored"))


def _diagnostics(errors: list[str]) -> tuple[Diagnostic, ...]:
    """The server's `FILE:LINE:COL: message` lines as diagnostics, so that an edit's errors
    can be pointed at the edit here as in-process."""
    found = []
    for line in errors:
        if m := re.fullmatch(r"(.+):(\d+):(\d+): (.*)", line, re.DOTALL):
            at, col = int(m[2]), int(m[3])
            span = Span(file=m[1], line=at, column=col, end_line=at, end_column=col + 1)
            found.append(Diagnostic(span=span, message=m[4]))
    return tuple(found) if len(found) == len(errors) else ()


class RemoteError(ShunterError):
    """The server could not be reached, or refused an admin request."""


class Remote:
    """A running `shunter serve`, through its admin routes."""

    workload: Workload | None = None

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s,
                                  transport=transport)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> dict:
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RemoteError(f"cannot reach {self.url}: {exc}") from None
        try:
            body = r.json()
        except ValueError:
            raise RemoteError(f"{method} {self.url}{path} answered {r.status_code} without "
                              f"JSON") from None
        if r.status_code == 400 and body.get("error", {}).get("code") == "policy_error":
            raise PolicyCheckError(body.get("detail") or body["error"]["message"],
                              diagnostics=_diagnostics(body.get("errors") or []))
        if r.status_code == 409:
            return {}
        if r.status_code >= 400:
            message = body.get("error", {}).get("message", r.text)
            raise RemoteError(f"{method} {path}: {r.status_code} {message}")
        return body

    def _policy(self) -> dict:
        return self._call("GET", "/admin/policy")

    def policy(self) -> RunningPolicy:
        p = self._policy()
        return RunningPolicy(name=p["name"], version=p["version"], source=p["source"],
                             filename=p["filename"], classes=tuple(p["classes"]))

    def explain(self) -> str:
        return self._policy()["explain"]

    def status(self) -> Status:
        return Status.from_json(self._call("GET", "/admin/stats"))

    def load(self, path: Path) -> Switched:
        try:
            source = path.read_text()
        except OSError as exc:
            raise RemoteError(f"cannot read {path}: {exc.strerror}") from None
        return self.replace(source, str(path))

    def replace(self, source: str, filename: str) -> Switched:
        change = self._call("PUT", "/admin/policy", content=source.encode(),
                            params={"filename": filename})
        return _remote_switched(change)

    def rollback(self) -> Switched | None:
        change = self._call("POST", "/admin/policy/rollback")
        if not change:
            return None
        return _remote_switched(change)

    def last_diff(self) -> tuple[int, str] | None:
        p = self._policy()
        if p["last_diff"] is None:
            return None
        return p.get("previous_version") or p["version"] - 1, p["last_diff"]
