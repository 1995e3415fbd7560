"""The REPL's command layer: `ReplSession.execute(line) -> str`, no terminal needed.

The engine and the workload run on an event loop in a background thread (an anyio blocking
portal); commands call into it and return text.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.from_thread

from engine.config import EngineConfig
from engine.errors import ShunterError
from engine.policy import Policy
from policies import policy_dir, policy_path
from policy_lang.api import compile_policy, load_policy_file
from policy_lang.diagnostics import did_you_mean
from policy_lang.edit import replace_rule
from shunter.engine import Engine
from shunter.policy_source import source_diff
from shunter.repl.stats import class_stats, table
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
  diff                  what changed from the previous policy to the running one
  rollback              go back to the previous policy
  workload pause | resume | rate N
                        control the background workload (N requests per second)
  help                  this text
  quit                  stop the engine and leave"""


class ReplSession:
    def __init__(self, portal: anyio.from_thread.BlockingPortal, engine: Any,
                 workload: Workload) -> None:
        self._portal = portal
        self.engine = engine
        self.workload = workload
        self.previous: list[Policy] = []
        """Policies replaced so far, the latest last (what `diff` and `rollback` use)."""
        self.done = False
        self._since = time.monotonic()

    def execute(self, line: str) -> str:
        line = line.strip()
        if not line or line.startswith("#"):
            return ""
        command, _, rest = line.partition(" ")
        if command not in COMMANDS:
            return f"unknown command '{command}'{did_you_mean(command, COMMANDS)} (type help)"
        try:
            return getattr(self, f"_{command}")(rest.strip())
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
        s = self._portal.call(self.engine.inspect).scheduler
        w = self.workload
        finished, failed, in_flight = self._portal.call(
            lambda: (list(w.finished), w.failed, dict(w.in_flight)))
        state = "paused" if w.paused else f"{w.rate:g} requests/s"
        current = [f for f in finished if f.epoch == w.epoch]
        rows = [class_stats(label, [f.timeline for f in current if f.label == label])
                for label in ("rt", "be")]
        return "\n".join([
            f"policy {s.policy} for {time.monotonic() - self._since:.0f} s; iteration "
            f"{s.iteration}, last one {s.iteration_ms:.1f} ms",
            f"queues: {s.waiting} waiting, {s.running} running, {s.swapped} swapped, "
            f"{s.swapping_in} swapping in; {s.free_blocks} of {s.total_blocks} KV blocks free; "
            f"{s.preemptions} preemptions",
            f"overload: {s.overload or 'none'} (drop fired {s.overload_drops} times, restore "
            f"{s.overload_restores})",
            f"workload: {state}; in flight rt {in_flight['rt']}, be {in_flight['be']}; "
            f"{len(finished)} finished, {failed} failed",
            f"since {s.policy} was loaded:",
            table(rows),
        ])

    def _show(self, _: str) -> str:
        p = self.engine.policy
        where = getattr(p, "filename", "built in")
        return f"# running: {p.settings.name} ({where})\n{p.source.rstrip()}"

    def _explain(self, _: str) -> str:
        explain = getattr(self.engine.policy, "explain", None)
        if explain is None:
            return f"{self.engine.policy.settings.name} is a built-in Python policy"
        return explain().rstrip()

    def _load(self, arg: str) -> str:
        if not arg:
            return "usage: load FILE | NAME"
        path = Path(arg)
        if not path.exists() and "/" not in arg and not arg.endswith(".policy"):
            path = policy_path(arg)
        new = load_policy_file(path, capabilities=self.engine.capabilities)
        old = self._switch(new)
        return f"running {new.settings.name} from {path} (was {old.settings.name})"

    def _edit(self, rule: str) -> str:
        if not rule:
            return "usage: edit RULE   e.g. edit priority rt = slack asc"
        current = self.engine.policy
        filename = getattr(current, "filename", "<running>")
        source = replace_rule(current.source, rule, filename=filename)
        new = compile_policy(source, filename=filename,
                             base_dir=getattr(current, "base_dir", None) or policy_dir(),
                             capabilities=self.engine.capabilities)
        self._switch(new)
        return source_diff(current, new).rstrip() or "(no change)"

    def _diff(self, _: str) -> str:
        if not self.previous:
            return "no previous policy: nothing has been loaded or edited yet"
        return source_diff(self.previous[-1], self.engine.policy).rstrip() or "(no difference)"

    def _rollback(self, _: str) -> str:
        if not self.previous:
            return "nothing to roll back to"
        back, current = self.previous.pop(), self.engine.policy
        self._replace(back)
        return f"running {back.settings.name} again (was {current.settings.name})"

    def _workload(self, arg: str) -> str:
        w = self.workload
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

    # ------------------------------------------------------------------------ switching

    def _switch(self, new: Policy) -> Policy:
        old = self.engine.policy
        self._replace(new)
        self.previous.append(old)
        return old

    def _replace(self, new: Policy) -> None:
        self._portal.call(functools.partial(self.engine.replace_policy, new))
        self.workload.epoch += 1
        self._since = time.monotonic()


@contextlib.contextmanager
def open_session(config: EngineConfig, *, backend: Any = None, policy: Policy | None = None,
                 rate: float = 4.0, seed: int = 0, max_in_flight: int = 32,
                 async_backend: str = "asyncio") -> Iterator[ReplSession]:
    """Start an engine and the workload on a background event loop; stop both on exit."""
    with anyio.from_thread.start_blocking_portal(backend=async_backend) as portal:
        started = Engine.start(config, policy=policy, backend=backend)
        with portal.wrap_async_context_manager(started) as engine:
            workload = Workload(engine, rate=rate, seed=seed, max_in_flight=max_in_flight)
            running = portal.start_task_soon(workload.run)
            try:
                yield ReplSession(portal, engine, workload)
            finally:
                running.cancel()
                with contextlib.suppress(Exception):
                    running.exception()

