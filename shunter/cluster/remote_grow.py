"""A running pipeline group of torch instance processes grows (KunServe §4.1: the drop plan
merged it with instances serving alone), the front door's side; the head's:
shunter/cluster/instance_grow.py, the runners': gpu/group_grow.py.

The grown group keeps its head and order, the new members come last, and the layers are split
again evenly (engine/cluster/plan.py `stage_layers`). The head is asked first whether that split
grows its pool (nothing moves if not); then each new member hands its requests over
(`ExportGroup`, as when a group forms) and the head grows the group (`GrowGroup`). A new member
that cannot join after others handed their requests over: the head recomputes those and lets
them go (`HeadGroup.not_formed`); the group goes on as it was.

Two running groups merge (Algorithm 6 merges the smallest groups, which may be groups already):
the group whose head leads the plan (else the larger) stays. Directly (`DIRECT`, the default):
instances of the plan serving alone hand their requests over first, as in a growth; the
other's head hands its requests over (`HandOverGroup`; refused while its last exchange runs:
postponed, the alone instances' requests recomputed at the staying head) and the staying head
grows the group with the alone instances, then the joining ones in their order (the joining
group's last stage stays the last), each of the joining group's requests' KV sent from the
members holding it to those keeping those layers now (`MergeGroup.parts`,
gpu/group_merge.py): it moves once. With `direct=False`: the other restores first (§4.4: its
head takes every layer and its requests' KV back, its members serve alone), then its instances
join as instances serving alone do (its KV moves twice: back to its head, then out again); a
merge whose joining group's requests do not fit its head's own pool yet is postponed (asked
again next round), as a restore is.
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


RESTORED_S = 30.0
"""How long a merge waits for the joining group's head to have restored (its next step does it)."""


class CannotGrow(RuntimeError):
    """The head refused the grown split before anything moved (its pool would not grow)."""


class Postponed(RuntimeError):
    """A merge's joining group cannot restore yet (its requests do not fit its head's own pool):
    nothing moved; asked again next round."""


def merges(groups: dict[int, GroupPlan], g: GroupPlan) -> tuple[GroupPlan, GroupPlan] | None:
    """(the running group that stays, the one that joins) when `g` holds exactly two running
    groups whole and otherwise instances serving alone; None otherwise. The one staying: the
    one whose head leads `g`, else the larger, else the lower head."""
    running = [old for old in groups.values() if set(old.members) & set(g.members)]
    if len(running) != 2 or not all(set(old.members) <= set(g.members) for old in running):
        return None
    stays, joins = sorted(running, key=lambda old: (old.head != g.head, -old.size, old.head))
    return stays, joins


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


DIRECT = True
"""A merge hands the joining group's requests over straight from its members (`merge`); False:
it restores first, then its instances join as instances serving alone do."""


async def merge(groups, stays: GroupPlan, joins: GroupPlan, g: GroupPlan, *,
                direct: bool | None = None) -> GroupPlan:
    """Group `joins` merges into `stays`: directly (`direct`, default `DIRECT`: its head hands
    its requests over, its members send the KV of the layers others keep now: gpu/group_merge.py;
    instances alone in `g` join as in a growth) or by restoring first and growing. Returns the
    grown plan; raises `CannotGrow` or `Postponed` (nothing of the groups moved), or
    `GroupCommandError`."""
    from shunter.cluster.remote_groups import GroupCommandError

    if direct if direct is not None else DIRECT:
        return await _merge_direct(groups, stays, joins, g)
    await _check(groups, stays.head, grown_plan(stays, g, groups.num_layers))
    if not await groups.restore(joins.head):
        raise Postponed(f"group {joins.members} does not fit its head's own pool yet")
    with anyio.move_on_after(RESTORED_S):
        while (await groups.stats(joins.head))["head"]["leading"]:  # its next step restores
            await anyio.sleep(0.005)
    if (await groups.stats(joins.head))["head"]["leading"]:
        raise GroupCommandError(f"instance {joins.head}: its group {joins.members} had not "
                                f"restored {RESTORED_S:.0f} s after it was asked (merging "
                                f"into {stays.members})")
    plan = await grow(groups, stays, g, checked=True)
    groups.counters.events.append({"t": anyio.current_time(), "event": "merge",
                                   "from": [list(stays.members), list(joins.members)],
                                   "members": list(plan.members)})
    return plan


async def _merge_direct(groups, stays: GroupPlan, joins: GroupPlan, g: GroupPlan) -> GroupPlan:
    """Instances of `g` serving alone hand their requests over to the staying head first, as in
    a growth; then the joining head hands its requests over (`HandOverGroup`; a group whose
    last exchange has not settled refuses: `Postponed`, the requests of those alone are
    recomputed at the staying head) and the staying head grows the group with the instances
    alone, then the joining ones (its last stage stays the last: the seeded generators of its
    requests stay there), the KV of the joining group's requests from where it lies
    (`MergeGroup.parts`)."""
    from shunter.cluster.instance_grow import HandOverGroup, MergeGroup
    from shunter.cluster.remote_groups import GroupCommandError

    alone = tuple(sorted(set(g.members) - set(stays.members) - set(joins.members)))
    members = stays.members + alone + joins.members  # the joining group's order: its head first
    plan = GroupPlan(group_id=g.group_id, members=members,
                     layers=stage_layers(groups.num_layers, len(members)))
    await _check(groups, stays.head, plan)
    adopted = await _export_alone(groups, stays.head, plan, alone, stays.size)
    try:
        moved = await groups._command(joins.head, lambda key: HandOverGroup(key=key,
                                                                            head=stays.head))
    except GroupCommandError as exc:  # refused before anything of the group moved
        if alone:
            await groups._give_up(plan, adopted, alone, f"group {joins.members} did not hand "
                                  f"over ({exc})")
        raise Postponed(str(exc)) from exc
    src, to = groups.instances[joins.head], groups.instances[stays.head]
    for mv in moved:  # their outputs (and cancels) now go through the staying head
        live = src._live.pop(mv.cluster_key, None)
        if live is not None:
            to._live[mv.cluster_key] = live
            src.moved_to[mv.cluster_key] = to
    for inst in groups.instances:  # handed to the joining head before: at the staying one now
        for key in [k for k, t in inst.moved_to.items() if t is src and k in to._live]:
            inst.moved_to[key] = to
    del groups.groups[joins.head]
    k = plan.members.index(joins.head)
    parts = tuple((plan.members.index(m), r) for m, r in zip(joins.members, joins.layers,
                                                             strict=True))
    adopted += [(k, mv) for mv in moved]
    try:
        grown = await _grown(groups, stays, plan, lambda key: MergeGroup(
            key=key, plan=plan, adopted=tuple(adopted), parts=parts), len(adopted))
    except Exception:
        await groups.coordinator.send(GroupsChanged(restored=joins.head))
        raise
    groups.counters.events.append({"t": anyio.current_time(), "event": "merge", "direct": True,
                                   "from": [list(stays.members), list(joins.members)],
                                   "members": list(grown.members)})
    return grown


async def _export_alone(groups, head: int, plan: GroupPlan, alone, first: int) -> list:
    """Each of `alone` (members `first`... of `plan`) hands its requests over to `head`; one
    that cannot after others did: the head recomputes theirs (`_give_up`), and it is raised."""
    from shunter.cluster.remote_groups import GroupCommandError

    adopted, exported = [], []
    for k, m in enumerate(alone, start=first):
        try:
            adopted += [(k, mv) for mv in await groups._export(head, m)]
        except (GroupCommandError, EngineDeadError) as exc:
            if exported:
                await groups._give_up(plan, adopted, exported,
                                      f"instance {m} could not join ({exc})")
            raise
        exported.append(m)
    return adopted


async def _check(groups, head: int, plan: GroupPlan) -> None:
    """The head refuses a split that would not grow its pool: `CannotGrow`, nothing moved."""
    from shunter.cluster.remote_groups import GroupCommandError

    try:
        await groups._command(head, lambda key: GrowGroup(key=key, plan=plan, check=True))
    except GroupCommandError as exc:
        raise CannotGrow(str(exc)) from exc


async def grow(groups, old: GroupPlan, g: GroupPlan, *, checked: bool = False) -> GroupPlan:
    """`groups`: the cluster's `RemoteGroups`. Returns the grown plan; raises
    `GroupCommandError` (naming the instance) when the group did not grow. `checked`: the head
    was asked already whether the split grows its pool."""
    plan = grown_plan(old, g, groups.num_layers)
    head, n_old = old.head, len(old.members)
    if not checked:
        await _check(groups, head, plan)
    adopted = await _export_alone(groups, head, plan, plan.members[n_old:], n_old)
    return await _grown(groups, old, plan, lambda key: GrowGroup(
        key=key, plan=plan, adopted=tuple(adopted)), len(adopted))


async def _grown(groups, old: GroupPlan, plan: GroupPlan, make, adopted: int) -> GroupPlan:
    """The head grows `old` to `plan` (`make(key)`: its `GrowGroup`); the bookkeeping."""
    from shunter.cluster.remote_groups import GroupCommandError

    head = old.head
    try:
        counts = await groups._command(head, make)
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
    c.adopted_requests += adopted
    c.events.append({"t": anyio.current_time(), "event": "grow", "from": list(old.members),
                     "members": list(plan.members), **counts})
    log.info("group grew", members=plan.members, **counts)
    await groups.note_kv(head)  # (every member's KV moved in the growth, counted at the head)
    return plan


async def _leads(groups, head: int) -> bool:
    try:
        stats = (await groups.stats(head))["head"]
    except Exception:  # noqa: BLE001 (gone: it leads nothing)
        return False
    return bool(stats and stats.get("leading"))
