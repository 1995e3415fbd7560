"""A one-line progress bar on stderr, redrawn at most a few times a second of wall time (it is
called on every finished request, which under a simulator is thousands of times a second)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int | None, *, stream: TextIO | None = None,
                 clock: object = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.began = time.perf_counter()
        self.last = 0.0
        self.sim_time = clock  # callable giving the engine clock, for the "simulated" column
        self.done = self.failed = 0

    def update(self, done: int, failed: int) -> None:
        self.done, self.failed = done, failed
        now = time.perf_counter()
        if now - self.last < (0.25 if self.live else 10.0):
            return
        self.last = now
        self._draw(now)

    def close(self) -> None:
        self._draw(time.perf_counter())
        if self.live:
            self.stream.write("\n")
        self.stream.flush()

    def _draw(self, now: float) -> None:
        n = self.done + self.failed
        if self.total:
            frac = min(1.0, n / self.total)
            bar = "#" * int(frac * 30)
            head = f"[{bar:30s}] {n}/{self.total}"
        else:
            head = f"{n} requests"
        sim = f"  engine clock {self.sim_time():8.1f} s" if callable(self.sim_time) else ""
        line = (f"{self.label}: {head}  failed {self.failed}{sim}  wall {now - self.began:6.1f} s")
        if self.live:
            self.stream.write("\r\x1b[2K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
