"""The progress bar `shunter bench` shows on stderr while a run replays (rich.progress).

`update` is called on every finished request, which under a simulator is thousands of times a
second, so it hands rich a new count at most ten times a second of wall time. On a terminal the
bar redraws in place; elsewhere (CI, a pipe) rich prints it once, when the run ends."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(self, label: str, total: int | None, *, stream: TextIO | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.clock = clock
        """The engine clock (simulated seconds under the sim), read on the event loop's thread."""
        self.done = self.failed = 0
        self._last = 0.0
        console = Console(file=stream or sys.stderr, highlight=False)
        counted = MofNCompleteColumn() if total else TextColumn("{task.completed} requests")
        columns = [TextColumn("{task.description}:"), BarColumn(bar_width=30), counted,
                   TextColumn("failed {task.fields[failed]}")]
        if clock is not None:
            columns.append(TextColumn("engine clock {task.fields[clock]:.1f} s"))
        columns += [TextColumn("wall"), TimeElapsedColumn()]
        self._bar = RichProgress(*columns, console=console, refresh_per_second=4)
        self._task = self._bar.add_task(label, total=total, failed=0, clock=self._clock())
        self._bar.start()

    def _clock(self) -> float:
        return self.clock() if self.clock is not None else 0.0

    def update(self, done: int, failed: int) -> None:
        self.done, self.failed = done, failed
        now = time.perf_counter()
        if now - self._last < 0.1:
            return
        self._last = now
        self._push()

    def _push(self) -> None:
        self._bar.update(self._task, completed=self.done + self.failed, failed=self.failed,
                         clock=self._clock())

    def close(self) -> None:
        self._push()
        self._bar.stop()
