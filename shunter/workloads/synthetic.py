"""Seeded synthetic workloads: arrival processes, requests drawn from a length table, and
multi-turn conversations (a stand-in for the ShareGPT multi-round set FastSwitch uses, which is
not available here: see `../shared/traces/README.md`)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from shunter.workloads.workload import RequestSpec


def arrivals(rng: random.Random, *, rate: float, n: int | None = None,
             until: float | None = None, process: str = "poisson", cv: float = 1.0) -> list[float]:
    """Arrival times (s) at `rate` per second: Poisson (exponential gaps) or Gamma gaps with
    coefficient of variation `cv` (cv > 1 is burstier than Poisson)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if n is None and until is None:
        raise ValueError("give a number of arrivals or an end time")
    if process == "gamma":
        shape = 1.0 / (cv * cv)
        gap = lambda: rng.gammavariate(shape, 1.0 / (rate * shape))  # noqa: E731
    elif process == "poisson":
        gap = lambda: rng.expovariate(rate)  # noqa: E731
    else:
        raise ValueError(f"arrival process must be poisson or gamma, got {process!r}")
    out: list[float] = []
    t = 0.0
    while n is None or len(out) < n:
        t += gap()
        if until is not None and t >= until:
            break
        out.append(t)
    return out


def from_length_table(rng: random.Random, table: Sequence[tuple[int, int]],
                      times: Sequence[float]) -> list[RequestSpec]:
    """One request per arrival time, lengths drawn from the table with replacement."""
    return [RequestSpec(index=i, arrival_s=t, prompt_tokens=p, output_tokens=o)
            for i, (t, (p, o)) in enumerate(zip(times, (rng.choice(table) for _ in times)))]


def multiturn(rng: random.Random, table: Sequence[tuple[int, int]], starts: Sequence[float], *,
              mean_turns: float, mean_think_s: float, max_turns: int = 40,
              max_context: int | None = None) -> list[RequestSpec]:
    """Conversations starting at `starts`. Turns per conversation: 1 + geometric with mean
    `mean_turns`; each turn's new user tokens and answer length drawn from the table; the
    next turn is sent an exponential think time (mean `mean_think_s`) after the previous answer
    and its prompt is the whole conversation so far plus the new user tokens. A conversation
    ends early when its next turn would pass `max_context` tokens."""
    specs: list[RequestSpec] = []
    stop_p = 1.0 / max(1.0, mean_turns)
    for c, start in enumerate(starts):
        parent: RequestSpec | None = None
        turns = 1
        while turns < max_turns and rng.random() >= stop_p:
            turns += 1
        for turn in range(turns):
            new, out = rng.choice(table)
            if parent is None:
                spec = RequestSpec(index=len(specs), arrival_s=start, prompt_tokens=new,
                                   output_tokens=out, conversation_id=f"conv{c}")
            else:
                context = parent.prompt_tokens + parent.output_tokens
                if max_context is not None and context + new + out > max_context:
                    break
                spec = RequestSpec(
                    index=len(specs), arrival_s=start, prompt_tokens=context + new,
                    output_tokens=out, conversation_id=f"conv{c}", parent=parent.index,
                    shared_tokens=context, after_parent_s=rng.expovariate(1.0 / mean_think_s))
            specs.append(spec)
            parent = spec
    return specs
