"""`LeaveGroup` at the head's instance process (KunServe §4.4): its group restores, the dropped
layers written back while the group keeps serving (gpu/restore_prefetch.py), then the switch.

0. The group's KV exchange settles first (`_settled`): no live request still waits for its KV
   on some member, or was adopted and never set up here (it holds no blocks every member
   maps), or waits for the scheduler to hear its arrival (the arrivals task's set: after the
   restore no one would tell it, and it would wait for ever). The group serves meanwhile;
   one not settled within `SETTLE_S` refuses the restore as a pool too small does (the front
   door asks again later). (A request whose KV arrived but that no step ran since is fine:
   every member writes its chunks into its blocks before the restore reads them.)
1. The scheduler's pool shrinks back to the instance's own (`Regroup(pool_blocks)`, group
   kept: `PoolTooSmall` when its requests do not fit yet, and the front door asks again later);
   the next pipelined step carries the size and the blocks it moved (the members rebind them).
2. The runner starts the prefetch once that step ran (`prefetch_restore(after_shrink_to=)`):
   every member vacates its dropped layers' memory and their weights come back into it, from
   the members keeping them, on the KV lane behind activations; the group serves meanwhile.
   This waits until every member's are in (the members say so in each step's answer; an empty
   pipelined step asks them when no step ran for a while).
3. The scheduler's next step carries the plan of one (`Regroup(group=solo)`): that step's
   restore moves only the KV and switches every member to its whole model. With no live
   request, the runner restores at once (no step would carry it). The answer waits for that
   step (`_restored`): a restore that failed there before changing anything is tried again at
   the next steps, or here once no request is live (no step would come).

A member lost while the prefetch runs: a step that finds it fails as any grouped step does
(`GroupLost`: the head serves alone from its host copy, the engine recomputes every request);
found by this wait's own empty step, the runner recovers the same way and the scheduler is told
to recompute (`Regroup(recompute)`). Either way the group is over and the answer is the error
(`RestoreLost`): the front door's round ends the group as for any member lost while grouped. A
runner whose prefetch cannot start (`prefetch_refused`) restores everything at the boundary, as
one does under a policy with `restore_prefetch off` (the one-step restore). The policy's
`restore_from` says where the weights come from (peers, or each member's host copy); both are
read from the instance's policy at each `LeaveGroup`.
"""

from __future__ import annotations

import time

import anyio

from engine.cluster.adoption import PoolTooSmall
from engine.cluster.drop_plan import GroupPlan
from engine.messages import Regroup

POLL_S = 0.005
LIMIT_S = 120.0
"""The wait's bound: a prefetch that never started (no step carried the shrink) or never
ended (a member stuck but not known lost) leaves the rest to the restore's boundary."""
SETTLE_S = 10.0
"""How long a restore waits for its group's KV exchange to settle before it is refused (as
shunter/cluster/instance_grow.py's growth: the adopted requests must have run a step here)."""
RESTORED_S = 30.0
"""How long the answer waits for the step that restores (the front door's own wait)."""
QUIET_S = 0.05
"""No step sent for this long: the wait asks the members itself (an empty pipelined step)."""


async def leave_here(groups) -> dict:
    """`groups`: the instance's InstanceGroups (shunter/cluster/instance_groups.py)."""
    from shunter.cluster.instance_groups import _ask

    eng, runner = groups.engine, groups.runner
    group = runner.group
    if group is None:
        if runner.last_group is None:
            raise RuntimeError("this instance leads no group")
        # it ended at a step since the front door last asked (restored there after a failed
        # try, or given up): answered as over, so the front door lets it go (else it asked
        # again every round for good, its members redirected to a head leading nothing)
        return {"ended_already": runner.last_ended, "restored_at_once": False}
    solo = GroupPlan(group_id=-1, members=(group.ranks[0],), layers=(
        range(runner._model_config.num_layers),))
    await _settled(groups, group)
    m = eng.policy.settings.memory  # (the policy now: a replaced one applies to this restore)
    runner.restore_prefetch, runner.restore_source = m.restore_prefetch, m.restore_from
    prefetch = runner.restore_prefetch
    await _ask(eng._scheduler_send, lambda r: Regroup(
        pool_blocks=runner.num_blocks, group=None if prefetch else solo, reply=r))
    live = await _live(eng)
    out: dict = {"prefetched": False, "live_at_leave": live}
    if prefetch and live:
        began = anyio.current_time()
        state = await _prefetched(groups, group)
        out.update(prefetched=state == "ready", prefetch_state=state,
                   prefetch_wait_s=anyio.current_time() - began)
        if state in ("lost", "gone"):  # the group is over: every request was recomputed
            raise RestoreLost(f"the group lost a member while its restore was prefetched "
                              f"({runner.lost}); instance {group.ranks[0]} serves alone from "
                              f"its host copy and recomputes every request")
        await _ask(eng._scheduler_send, lambda r: Regroup(group=solo, reply=r))
    elif prefetch:
        await _ask(eng._scheduler_send, lambda r: Regroup(group=solo, reply=r))
    idle = not await _live(eng)
    if idle:  # no step will come to carry the restore
        await runner._thread.run(runner.dissolve_idle)
    else:
        await _restored(groups, group)
    return {**out, "restored_at_once": idle}


async def _restored(groups, group) -> None:
    """Until a step restored `group` (at most `RESTORED_S`; the front door then waits for it as
    before). One that failed before changing anything is tried again at the runner's next
    steps (gpu/kunserve_runner.py `_restore_at`); once no request is live no step comes, so it
    is tried here (`dissolve_idle`; its error is the answer: the front door asks again later)."""
    runner, began = groups.runner, time.monotonic()
    while runner.group is group and time.monotonic() - began < RESTORED_S:
        if runner.restore_failures and not await _live(groups.engine):
            await runner._thread.run(runner.dissolve_idle)
            return
        await anyio.sleep(POLL_S)


async def _live(eng) -> tuple[int, ...]:
    return (await eng.inspect()).scheduler.live_requests


async def _settled(groups, group) -> None:
    """Wait until no live request's KV is still moving into `group` (step 0 above); raises
    `PoolTooSmall` (the front door retries later) if that takes over `SETTLE_S`."""
    from gpu.group_grow import unsettled

    deadline = anyio.current_time() + SETTLE_S
    while True:
        live = await _live(groups.engine)
        arrivals = getattr(groups, "arrivals", None)
        unheard = set(arrivals[1]) if arrivals is not None and arrivals[0] is group else set()
        waiting = await groups.runner._thread.run(unsettled, group, live) | (unheard & set(live))
        if not waiting or groups.runner.group is not group:
            return
        if anyio.current_time() >= deadline:
            raise PoolTooSmall(f"group {group.ranks} cannot restore yet: requests "
                               f"{sorted(waiting)} still wait for its KV exchange")
        await anyio.sleep(POLL_S)


async def _prefetched(groups, group) -> str:
    """Wait until every member's weights are in: 'ready'; 'refused' (the prefetch could not
    start: the boundary moves them), 'idle' (every request ended before a step carried the
    shrink: the runner restores at once), 'late' (`LIMIT_S`), 'lost' (this wait found a
    member gone: recovered, the scheduler told) or 'gone' (a step found it: the engine
    recomputes already)."""
    from shunter.cluster.instance_groups import _ask

    runner, began = groups.runner, time.monotonic()
    state = await runner._thread.run(_state, runner, group, True)
    while True:
        if state == "lost":
            me = group.ranks[0]
            solo = GroupPlan(group_id=-1, members=(me,), layers=(
                range(runner._model_config.num_layers),))
            await _ask(groups.engine._scheduler_send, lambda r: Regroup(
                recompute=True, pool_blocks=runner.num_blocks, group=solo, reply=r))
        if state != "waiting":
            return state
        if runner.prefetch_pending and not await _live(groups.engine):
            return "idle"  # no step will carry the shrink: the idle restore needs none
        if time.monotonic() - began > LIMIT_S:  # the restore waits for the rest itself
            return "late"
        await anyio.sleep(POLL_S)
        state = await runner._thread.run(_state, runner, group)


def _state(runner, group, start: bool = False) -> str:
    """On the device thread: where the group's prefetch is (`start`: ask for it first; one
    that breaks the group as it starts, `PrefetchBroken`, ends it as a loss does)."""
    from gpu.data_plane import GroupMemberLost

    if runner.group is not group:
        return "gone"
    try:
        if start:
            runner.prefetch_restore(runner.restore_source, runner.num_blocks)
        runner.start_pending_prefetch()
        if time.monotonic() - group.last_step > QUIET_S:
            group.poll(0)  # no step for a while: the members answer an empty one
        ready = group.restore_ready()
    except GroupMemberLost as exc:
        runner.lose_group(exc)
        return "lost"
    if ready is None:
        return "waiting" if runner.prefetch_pending else "refused"
    return "ready" if ready else "waiting"


class RestoreLost(RuntimeError):
    """A member was lost while the restore was prefetched: the group is over, the head serves
    alone and recomputes its requests."""
