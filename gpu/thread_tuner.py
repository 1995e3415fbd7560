"""Chooses torch's CPU thread count from the engine's own step times, while it serves.

Why: torch parallelises each CPU kernel over OpenMP threads that wait for each other at the end
of every parallel region. On a quiet machine one thread per core is fastest (or as fast as one
thread, for a small model). But when another process keeps a core busy, the thread that shares
its core with that process holds up every region, and the whole step slows down: measured on a
2-core machine next to one busy process, 2 threads made generation 2.35x slower, 1 thread 1.02x
(`bench/contention.py`, `bench/results/contention.json`). No setting is right for both, and
a machine's load changes while the engine runs, so the count is measured, not guessed.

How: now and then the tuner runs a few pairs of consecutive steps of the same shape, one at
the current count and one at another candidate (alternating which goes first, so warm caches
favour neither), and moves to the candidate when its median time is at least `margin` lower.
Probes come soon after start, then at intervals that double while the choice holds (up to
`max_interval` steps), and at once when steps of one shape turn `drift` times slower than they
were after the last probe (another process has just started). A probe costs `pairs` steps at
the other count, or one when a pair differs `decisive` times or more (a 2-thread step next to a
busy process took 10x as long here): at the defaults about 2% of the steps where the other count
is 2x slower. Single steps are noisy (10% apart from one to the next on a quiet machine here),
hence the median of several pairs and the margin.

Only when the user named no `--threads`: an explicit count is kept as given.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Sequence

import attrs


@attrs.frozen(kw_only=True)
class ThreadSwitch:
    """One decision the tuner took: from `before` threads to `after`, and the median ratio of
    step times (candidate / current) it saw."""

    step: int
    before: int
    after: int
    ratio: float


def thread_candidates(cores: int) -> tuple[int, ...]:
    """Counts worth trying on a machine with `cores` usable cores: all of them, half, one."""
    return tuple(sorted({cores, max(1, cores // 2), 1}, reverse=True))


class ThreadTuner:
    """Wraps each step: `begin(shape)` sets the thread count for it, `end(seconds)` reports how
    long its compute took. `shape` is anything that equals between steps of the same work
    (the runner passes the number of sequences and tokens)."""

    def __init__(self, candidates: Sequence[int], set_threads: Callable[[int], None], *,
                 first_probe: int = 2, min_interval: int = 32, max_interval: int = 256,
                 pairs: int = 6, margin: float = 0.1, patience: int = 64,
                 drift: float = 1.5, decisive: float = 2.0) -> None:
        if not candidates:
            raise ValueError("ThreadTuner needs at least one candidate thread count")
        self._candidates = tuple(candidates)
        self._set = set_threads
        self._min_interval, self._max_interval = min_interval, max_interval
        self._interval = min_interval
        self._pairs = pairs
        self._margin = margin
        self._patience = patience
        self._drift = drift
        self._decisive = decisive
        self.current = max(self._candidates)
        """The thread count steps run at outside probes. It starts at the most (torch's own
        choice); next to busy processes, where those steps took 10x as long here, the first
        probe, at the second step, ends after one lopsided pair."""
        self.switches: list[ThreadSwitch] = []
        """Every change of `current`, oldest first."""
        self.probes = 0
        """Probes finished (whether or not they switched)."""
        self._steps = 0
        self._next_probe = first_probe
        self._last_probe_end = 0
        self._rival_turn = 0
        self._probe: _Probe | None = None
        self._shape: Hashable = None
        self._usual: dict[Hashable, float] = {}  # shape -> its first time since the last probe
        self._slow_streak = 0
        self._running = self.current
        self._set(self.current)

    def begin(self, shape: Hashable) -> None:
        self._steps += 1
        self._shape = shape
        if self._probe is None and self._steps >= self._next_probe and len(self._candidates) > 1:
            self._probe = _Probe(rival=self._next_rival(), deadline=self._steps + self._patience)
        threads = (self.current if self._probe is None
                   else self._probe.threads_for(shape, self.current))
        if threads != self._running:
            self._set(threads)
            self._running = threads

    def end(self, seconds: float) -> None:
        if self._probe is None:
            self._watch_drift(seconds)
            return
        self._probe.record(seconds)
        ratios = self._probe.ratios
        decided = bool(ratios) and not 1 / self._decisive < ratios[-1] < self._decisive
        if decided or len(ratios) >= self._pairs or self._steps >= self._probe.deadline:
            self._finish_probe()

    def _watch_drift(self, seconds: float) -> None:
        """Probe early after a run of same-shape steps `drift` times slower than that shape was."""
        usual = self._usual.get(self._shape)
        if usual is None:
            if len(self._usual) < 256:
                self._usual[self._shape] = seconds
            self._slow_streak = 0
            return
        self._slow_streak = self._slow_streak + 1 if seconds > self._drift * usual else 0
        if self._slow_streak >= 3:
            self._slow_streak = 0
            self._next_probe = min(self._next_probe, self._last_probe_end + self._min_interval // 2)

    def _next_rival(self) -> int:
        rivals = [c for c in self._candidates if c != self.current]
        rival = rivals[self._rival_turn % len(rivals)]
        self._rival_turn += 1
        return rival

    def _finish_probe(self) -> None:
        probe, self._probe = self._probe, None
        self.probes += 1
        ratio = probe.median_ratio()
        if ratio is not None and ratio <= 1.0 - self._margin:
            self.switches.append(ThreadSwitch(step=self._steps, before=self.current,
                                              after=probe.rival, ratio=ratio))
            self.current = probe.rival
            self._interval = self._min_interval  # confirm the new choice soon
        else:
            self._interval = min(2 * self._interval, self._max_interval)
        self._last_probe_end = self._steps
        self._next_probe = self._steps + self._interval
        self._usual.clear()
        self._slow_streak = 0


@attrs.define(slots=True)
class _Probe:
    """Pairs of consecutive same-shape steps, one at the current count and one at `rival`."""

    rival: int
    deadline: int
    ratios: list[float] = attrs.field(factory=list)
    """Step time at `rival` over step time at the current count, one per finished pair."""
    _first: tuple[Hashable, int, float] | None = None  # a pair's finished first step
    _running: tuple[Hashable, int] | None = None  # the step under way: shape, threads
    _rival_first: bool = False

    def threads_for(self, shape: Hashable, current: int) -> int:
        if self._first is not None and self._first[0] == shape:
            threads = current if self._first[1] == self.rival else self.rival
        else:  # no pair open, or the shape changed: start a pair here
            self._first = None
            threads = self.rival if self._rival_first else current
        self._running = (shape, threads)
        return threads

    def record(self, seconds: float) -> None:
        shape, threads = self._running
        if self._first is None:
            self._first = (shape, threads, seconds)
            return
        _, first_threads, first_s = self._first
        self._first = None
        rival_s, current_s = ((first_s, seconds) if first_threads == self.rival
                              else (seconds, first_s))
        if current_s > 0:
            self.ratios.append(rival_s / current_s)
        self._rival_first = not self._rival_first

    def median_ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None
