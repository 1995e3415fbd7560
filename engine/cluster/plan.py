"""Pipeline plans: layer ranges per stage, microbatches per step, and the stage-by-stage timing of
one step (the simulator's pipeline and the bubble ratio the benchmark reports).

A step runs GPipe-style inside one iteration: its sequences are cut into microbatches, stage s
runs microbatch m once it has finished microbatch m-1 and stage s-1's activations for m have
arrived. With K stages and M equal microbatches the idle share of the stages is (K-1)/(M+K-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import attrs

T = TypeVar("T")


def stage_layers(num_layers: int, stages: int) -> tuple[range, ...]:
    """Contiguous layer ranges, one per stage, sizes differing by at most one (the first stages
    take the extra layers: the last stage also runs the final norm and the LM head)."""
    if stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {stages}")
    if stages > num_layers:
        raise ValueError(f"{stages} pipeline stages for a model of {num_layers} layers: each "
                         f"stage needs at least one layer")
    base, extra = divmod(num_layers, stages)
    out, first = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(range(first, first + n))
        first += n
    return tuple(out)


def split_microbatches(work: Sequence[T], count: int, tokens: Sequence[int]) -> list[list[T]]:
    """Cut one step's sequences into at most `count` microbatches of about equal tokens, keeping
    their order (every stage cuts a step the same way, so none is told the cut). `tokens[i]` is
    the number of new tokens of `work[i]`. No microbatch is empty."""
    if not work:
        return []
    count = max(1, min(count, len(work)))
    total = sum(tokens)
    out: list[list[T]] = [[]]
    done = 0
    for item, n in zip(work, tokens):
        # open the next microbatch once this one holds its share of the tokens
        if out[-1] and len(out) < count and done >= total * len(out) / count:
            out.append([])
        out[-1].append(item)
        done += n
    return out


@attrs.frozen(kw_only=True)
class PipelineTiming:
    """When each stage ran each microbatch of one step (seconds from the step's start)."""

    finish: tuple[tuple[float, ...], ...]
    """finish[s][m]: when stage s finished microbatch m."""
    busy: tuple[float, ...]
    """Compute seconds of each stage in the step."""
    transfer_s: float
    """Seconds of activation transfer between stages on the critical path's links, summed."""

    @property
    def makespan(self) -> float:
        return max((row[-1] for row in self.finish if row), default=0.0)

    @property
    def bubble_ratio(self) -> float:
        """Share of stage time spent idle within the step: 1 - busy / (stages x makespan)."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * span)


def pipeline_timing(stage_costs: Sequence[Sequence[float]],
                    transfer: Sequence[float]) -> PipelineTiming:
    """stage_costs[s][m]: compute seconds of stage s on microbatch m; transfer[m]: seconds to
    send microbatch m's activations from one stage to the next."""
    stages = len(stage_costs)
    micro = len(stage_costs[0]) if stages else 0
    finish = [[0.0] * micro for _ in range(stages)]
    for s in range(stages):
        for m in range(micro):
            ready = finish[s][m - 1] if m else 0.0
            if s:
                ready = max(ready, finish[s - 1][m] + transfer[m])
            finish[s][m] = ready + stage_costs[s][m]
    return PipelineTiming(finish=tuple(tuple(r) for r in finish),
                          busy=tuple(sum(c) for c in stage_costs),
                          transfer_s=sum(transfer) * max(0, stages - 1))


@attrs.define
class PipelineTotals:
    """What the simulated pipeline did, summed over steps."""

    steps: int = 0
    makespan_s: float = 0.0
    busy_s: float = 0.0
    """Stage-seconds of compute."""
    stage_s: float = 0.0
    """Stage-seconds available (stages x makespan)."""
    transfer_s: float = 0.0
    microbatches: int = 0

    @property
    def bubble_ratio(self) -> float:
        return 1.0 - self.busy_s / self.stage_s if self.stage_s else 0.0

    def add(self, t: PipelineTiming, micro: int) -> None:
        self.steps += 1
        self.makespan_s += t.makespan
        self.busy_s += sum(t.busy)
        self.stage_s += len(t.busy) * t.makespan
        self.transfer_s += t.transfer_s
        self.microbatches += micro
