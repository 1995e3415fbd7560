"""A pipeline group's head keeps its members waiting (shunter/cluster/instance_groups.py starts
it with the group): a member waits for its next step in one receive on the data plane's world
(gpu/group_member.py), which gloo ends after the plane's timeout (60 s); the member then takes
the head as lost and leaves, and the head finds it gone at its next step. A group left idle that
long (a policy without a restore rule keeps its groups after the burst) broke so. The head sends
an empty step (the one the arrivals' poll sends) when none went for a share of that timeout.
"""

from __future__ import annotations

import time

import anyio

from engine.cluster.drop_plan import GroupPlan
from engine.messages import ExecuteStep, Regroup

KEEPALIVE_SHARE = 0.25
"""An empty step when none went for this share of the data plane's timeout."""


async def keepalive(ig, group) -> None:
    """While `ig`'s runner leads `group` (grown or not). A member found lost by the empty step:
    the runner serves alone again and every request is recomputed, as when the arrivals' poll
    finds one."""
    from gpu.data_plane import data_plane
    from shunter.cluster.instance_groups import _ask

    runner = ig.runner
    every = data_plane().timeout_s * KEEPALIVE_SHARE
    while runner.group is group:
        await anyio.sleep(every / 4)
        if await runner._thread.run(_keep, runner, group, every) is None:
            solo = GroupPlan(group_id=-1, members=(group.ranks[0],), layers=(
                range(runner._model_config.num_layers),))
            await _ask(ig.engine._scheduler_send, lambda r: Regroup(
                recompute=True, pool_blocks=runner.num_blocks, group=solo, reply=r))
            return


def _keep(runner, group, every: float) -> bool | None:
    """On the device thread: an empty step if `group` is still led and none went for `every`
    seconds (its arrivals stay for `arrived()`). None: it found a member lost."""
    from gpu.data_plane import GroupMemberLost

    if runner.group is not group or time.monotonic() - group.last_step < every:
        return False
    try:
        group.execute(ExecuteStep(step_id=0, release=(), setups=(), blocks=(), seqs=()))
    except GroupMemberLost as exc:
        runner.lose_group(exc)
        return None
    return True
