"""A running pipeline group of torch instance processes grows (KunServe §4.1: the drop plan
merged it with instances serving alone), the front door's side; the head's:
shunter/cluster/instance_grow.py, the runners': gpu/group_grow.py.

The grown group keeps its head and order, the new members come last, and the layers are split
again evenly (engine/cluster/plan.py `stage_layers`). The head is asked first whether that split
grows its pool (nothing moves if not); then each new member hands its requests over
(`ExportGroup`, as when a group forms) and the head grows the group (`GrowGroup`). A new member
that cannot join after others handed their requests over: the head recomputes those and lets
them go (`HeadGroup.not_formed`); the group goes on as it was. A merge of two running groups
is not grown (the queued requests move instead, as before).
"""

from __future__ import annotations

import anyio
import structlog

from engine.cluster.drop_plan import GroupPlan
from engine.cluster.messages import GroupsChanged
from engine.cluster.plan import stage_layers
from engine.errors import EngineDeadError
from shunter.cluster.group_wire import GrowGroup

log = structlog.get_logger(actor="coordinator")


class CannotGrow(RuntimeError):
    """The head refused the grown split before anything moved (its pool would not grow)."""


def grows(groups: dict[int, GroupPlan], g: GroupPlan) -> GroupPlan | None:
    """The running group `g` grows when it holds exactly one running group and otherwise
    instances serving alone; None otherwise."""
    running = [old for old in groups.values() if set(old.members) & set(g.members)]
    if len(running) != 1 or not set(running[0].members) <= set(g.members):
        return None
    return running[0]


def grown_plan(old: GroupPlan, g: GroupPlan, num_layers: int) -> GroupPlan:
    members = old.members + tuple(sorted(set(g.members) - set(old.members)))
    return GroupPlan(group_id=g.group_id, members=members,
                     layers=stage_layers(num_layers, len(members)))


async def grow(groups, old: GroupPlan, g: GroupPlan) -> GroupPlan:
    """`groups`: the cluster's `RemoteGroups`. Returns the grown plan; raises
    `GroupCommandError` (naming the instance) when the group did not grow."""
    from shunter.cluster.remote_groups import GroupCommandError

    plan = grown_plan(old, g, groups.num_layers)
    head, n_old = old.head, len(old.members)
    try:
        await groups._command(head, lambda key: GrowGroup(key=key, plan=plan, check=True))
    except GroupCommandError as exc:  # the split would not grow its pool: nothing moved
        raise CannotGrow(str(exc)) from exc
    adopted, exported = [], []
    for k, m in enumerate(plan.members[n_old:], start=n_old):
        try:
            adopted += [(k, mv) for mv in await groups._export(head, m)]
        except (GroupCommandError, EngineDeadError) as exc:
            if exported:
                await groups._give_up(plan, adopted, exported,
                                      f"instance {m} could not join ({exc})")
            raise
        exported.append(m)
    try:
        counts = await groups._command(head, lambda key: GrowGroup(
            key=key, plan=plan, adopted=tuple(adopted)))
    except (GroupCommandError, EngineDeadError) as exc:
        if not await _leads(groups, head):  # broken while it grew: the head serves alone
            groups.groups.pop(head, None)
            await groups.coordinator.send(GroupsChanged(restored=head))
        gone = [groups.instances[m].failure for m in plan.members
                if not groups.instances[m].alive]
        if gone:  # the head names a member that never opened the grown channel only as lost
            raise GroupCommandError(f"group {old.members} did not grow to {plan.members}: "
                                    f"{'; '.join(gone)} ({exc})") from exc
        raise
    groups.groups[head] = plan
    await groups.coordinator.send(GroupsChanged(formed=plan))
    c = groups.counters
    c.adopted_requests += len(adopted)
    c.events.append({"t": anyio.current_time(), "event": "grow", "from": list(old.members),
                     "members": list(plan.members), **counts})
    log.info("group grew", members=plan.members, **counts)
    return plan


async def _leads(groups, head: int) -> bool:
    try:
        stats = (await groups.stats(head))["head"]
    except Exception:  # noqa: BLE001 (gone: it leads nothing)
        return False
    return bool(stats and stats.get("leading"))
