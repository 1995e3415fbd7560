"""The REPL's command layer: `ReplSession.execute(line) -> str`, no terminal needed.

The commands drive a `SessionBackend` (shunter/repl/backends.py): an engine and its workload on
an event loop in a background thread (an anyio blocking portal), or a running server's admin
routes over HTTP (`shunter repl --connect URL`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import anyio.from_thread

from engine.config import EngineConfig
from engine.errors import PolicyError, ShunterError
from engine.policy import Policy
from policies import find_policy
from policy_lang.diagnostics import did_you_mean
from policy_lang.edit import edit_rule
from shunter.engine import Engine
from shunter.repl.backends import Local, Remote, SessionBackend
from shunter.repl.workload import Workload

COMMANDS = ("status", "show", "explain", "load", "edit", "diff", "rollback", "workload", "help",
            "quit", "exit")

HELP = """\
commands:
  status                queues, preemptions, overload triggers; TTFT/TPOT and SLO attainment per class
  show                  the running policy's source
  explain               the running policy in plain words
  load FILE | NAME      run a policy file, or a shipped policy by name (bros, vtc, priority, ...)
  edit RULE             replace one rule of the running policy: edit priority rt = slack asc
  edit                  the same for a rule of several lines: type it, then a blank line (or
                        Esc Enter) applies it; Ctrl-C drops it
  diff                  what changed from the previous policy to the running one
  rollback              go back to the previous policy
  workload pause | resume | rate N
                        control the background workload (N requests per second)
  help                  this text
  quit                  stop the engine and leave"""


class ReplSession:
    def __init__(self, backend: SessionBackend) -> None:
        self.backend = backend
        self.done = False

    @property
    def engine(self) -> Any:
        """The in-process engine (None over HTTP)."""
        return getattr(self.backend, "engine", None)

    @property
    def workload(self) -> Workload | None:
        return self.backend.workload

    def execute(self, line: str) -> str:
        line = line.strip()
        if not line or line.startswith("#"):
            return ""
        command, *rest = line.split(maxsplit=1)
        if command not in COMMANDS:
            return f"unknown command '{command}'{did_you_mean(command, COMMANDS)} (type help)"
        try:
            return getattr(self, f"_{command}")(rest[0] if rest else "")
        except ShunterError as exc:
            return str(exc)

    # ------------------------------------------------------------------------ commands

    def _help(self, _: str) -> str:
        return HELP

    def _quit(self, _: str) -> str:
        self.done = True
        return "bye"

    _exit = _quit

    def _status(self, _: str) -> str:
        status = self.backend.status()
        lines = status.head()
        if (w := self.workload) is not None:
            finished, failed, in_flight = list(w.finished), w.failed, dict(w.in_flight)
            state = "paused" if w.paused else f"{w.rate:g} requests/s and {w.be_backlog} BE " \
                                              f"kept waiting or running"
            lines.append(f"workload: {state}; in flight rt {in_flight['rt']}, be "
                         f"{in_flight['be']}; {len(finished)} finished, {failed} failed")
        return "\n".join(lines + status.tail())

    def _show(self, _: str) -> str:
        p = self.backend.policy()
        return f"# running: {p.name} v{p.version} ({p.filename or 'built in'})\n" \
               f"{p.source.rstrip()}"

    def _explain(self, _: str) -> str:
        return self.backend.explain()

    def _load(self, arg: str) -> str:
        if not arg:
            return "usage: load FILE | NAME"
        path = find_policy(arg)
        done = self.backend.load(path)
        return f"applied: policy {done.new} v{done.version} from {path} (was {done.old} " \
               f"v{done.old_version})"

    def _edit(self, rule: str) -> str:
        if not rule:
            return "usage: edit RULE   e.g. edit priority rt = slack asc"
        current = self.backend.policy()
        filename = current.filename or "<running>"
        kept = f"not applied: the running policy is still {current.name} v{current.version}"
        try:
            edit = edit_rule(current.source, rule, filename=filename)
        except PolicyError as exc:  # the rule does not parse: the error is in the rule already
            return f"{kept}\n{exc}"
        try:
            done = self.backend.replace(edit.source, filename)
        except PolicyError as exc:
            return f"{kept}\n{edit.point_at_rule(exc, filename)}"
        return f"applied: policy {done.new} v{done.version}\n{done.diff.rstrip() or '(no change)'}"

    def _diff(self, _: str) -> str:
        last = self.backend.last_diff()
        if last is None:
            return "no previous policy: nothing has been loaded or edited yet"
        version, diff = last
        p = self.backend.policy()
        return f"v{version} -> v{p.version} ({p.name})\n{diff.rstrip() or '(no difference)'}"

    def _rollback(self, _: str) -> str:
        done = self.backend.rollback()
        if done is None:
            return "nothing to roll back to"
        return f"rolled back: v{done.old_version} -> v{done.version}, policy {done.new} as it " \
               f"ran in v{done.restored} (was {done.old})"

    def _workload(self, arg: str) -> str:
        w = self.workload
        if w is None:
            return "no workload here: the REPL drives one only in-process (without --connect)"
        match arg.split():
            case ["pause"]:
                w.paused = True
                return "workload paused"
            case ["resume"]:
                w.paused = False
                return f"workload resumed at {w.rate:g} requests/s"
            case ["rate", value]:
                try:
                    rate = float(value)
                except ValueError:
                    return f"rate must be a number of requests per second, got {value!r}"
                if rate < 0:
                    return f"rate must be >= 0, got {value}"
                w.rate = rate
                return f"workload rate {rate:g} requests/s"
        return "usage: workload pause | resume | rate N"


@contextlib.contextmanager
def open_session(config: EngineConfig, *, backend: Any = None, policy: Policy | None = None,
                 rate: float = 4.0, seed: int = 0, max_in_flight: int = 32,
                 async_backend: str = "asyncio") -> Iterator[ReplSession]:
    """Start an engine and the workload on a background event loop; stop both on exit."""
    with anyio.from_thread.start_blocking_portal(backend=async_backend) as portal:
        started = Engine.start(config, policy=policy, backend=backend)
        with portal.wrap_async_context_manager(started) as engine:
            # a BE backlog as deep as the batch: requests always wait, so the policy's order
            # shows in `status` on a fast machine as on a slow one
            workload = Workload(engine, rate=rate, seed=seed, max_in_flight=max_in_flight,
                                be_backlog=config.max_num_seqs)
            running = portal.start_task_soon(workload.run)
            try:
                yield ReplSession(Local(portal, engine, workload))
            finally:
                running.cancel()
                with contextlib.suppress(Exception):
                    running.exception()



@contextlib.contextmanager
def connect_session(url: str, *, api_key: str | None = None, **http: Any) -> Iterator[ReplSession]:
    """A session against a running server's admin routes."""
    remote = Remote(url, api_key=api_key, **http)
    try:
        yield ReplSession(remote)
    finally:
        remote.close()
