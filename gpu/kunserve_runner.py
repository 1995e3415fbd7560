"""The torch step runner that follows the engine's KunServe fields on `ExecuteStep` (the
engine side: engine/cluster/adoption.py): `group` (a `GroupPlan`: from this step run
as a pipeline over its members; a plan of one member: alone again), `pool_blocks` (the pool's
new size) and `moves` (blocks a shrinking pool relocated). The executor keeps calling one
runner; this one delegates to a `GroupRunner` (gpu/group_runner.py) while its instance heads a
group. Member instances do not step while grouped: they serve the head (`serve_member`).

What the step fields cannot carry is handed over before the step that forms the group:
`expect_adopted(...)`, the requests that moved here from other members, with the owner's ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from engine.messages import ExecuteStep, StepFinished
from gpu.group_runner import GroupRunner
from gpu.group_stage import Adopted
from gpu.runner import TorchRunner


class KunServeTorchRunner(TorchRunner):
    def __init__(self, *args, chunk_blocks: int = 4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chunk_blocks = chunk_blocks
        self.group: GroupRunner | None = None
        self._adopted: tuple[Adopted, ...] = ()
        self.last_group: GroupRunner | None = None
        """The group runner of the last group led (its counters outlive it)."""

    def expect_adopted(self, adopted: Sequence[Adopted]) -> None:
        """The requests the next group-forming step's plan adopts (ids on this engine, owner
        member index, the owner runner's id, tokens of KV there)."""
        self._adopted = tuple(adopted)

    def execute(self, step: ExecuteStep) -> StepFinished:
        plan = step.group
        if plan is not None and len(plan.members) > 1:
            if self.group is not None:
                raise RuntimeError(f"already leading group {self.group.ranks}; got plan "
                                   f"{plan.members}")
            self.group = GroupRunner(self, plan.members, plan.layers, self._adopted,
                                     chunk_blocks=self.chunk_blocks)
            self._adopted = ()
            pool = self.group.open()
            if step.pool_blocks is not None and step.pool_blocks > len(pool):
                raise RuntimeError(f"the engine's group pool of {step.pool_blocks} blocks is "
                                   f"larger than the group's {len(pool)} ({pool})")
        elif plan is not None and self.group is not None:  # a plan of one: alone again
            moved = dict(step.moves)
            group, self.group = self.group, None
            tables = {rid: [moved.get(b, b) for b in s.table]
                      for rid, s in group.stage.seqs.items() if rid not in step.release}
            group.restore(tables, release=step.release)
            self.last_group = group
            step = attrs.evolve(step, release=(), moves=(), group=None, pool_blocks=None)
        if self.group is not None:
            return self.group.execute(step)
        return super().execute(step)
