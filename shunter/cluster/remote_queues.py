"""Requests moved between torch instance processes while KunServe groups run, without KV (the
front door's side: shunter/cluster/remote_groups.py `RemoteGroups.act`, each monitor round):

- `reschedule_queued`: an instance serving alone whose queued demand exceeds its free memory
  sends its queue to the group head with the most free blocks (§4.1; the rule is
  engine/cluster/drop_plan.py `queue_moves`, shared with the simulator's instances).
- `sweep_members`: a request dispatched to a member while its group formed (after the member
  handed its requests over, before `GroupsChanged(formed)` redirected its new requests to the
  head) goes to the head. The member's device thread serves the group until it restores, so
  such a request would wait there, queued behind it, for the group's whole life (the
  simulator's `SimGroups._sweep_members` does the same, shunter/cluster/groups.py).

Both move only requests waiting with no KV (`ExportQueued` at the source, which its scheduler
carries out at once, not at a step boundary; `AdoptQueued` at the head). A request the
member's scheduler already put into a step (queued on its device thread behind the group)
stays: it runs once the group restores.
"""

from __future__ import annotations

import anyio
import structlog

from engine.cluster.drop_plan import queue_moves
from engine.errors import EngineDeadError
from shunter.cluster.group_wire import AdoptQueued, ExportQueued

log = structlog.get_logger(actor="coordinator")


async def reschedule_queued(groups, stats) -> None:
    """`groups`: the RemoteGroups; `stats`: each instance's last stats (None: none)."""
    for i, best in queue_moves(
            stats, block_size=groups.block_size,
            grouped={m for g in groups.groups.values() for m in g.members},
            heads=list(groups.groups), alive=[inst.alive for inst in groups.instances]):
        n = await _move(groups, i, best, "rescheduled")
        groups.counters.rescheduled_requests += n


async def sweep_members(groups, stats) -> None:
    """Every member whose stats show requests waiting hands them to its head (not while a
    restore is under way: `RemoteGroups.act` calls this only then)."""
    for head, g in list(groups.groups.items()):
        for m in g.members[1:]:
            st = stats[m] if m < len(stats) else None
            if st is None or not st.waiting or not groups.instances[m].alive:
                continue
            if n := await _move(groups, m, head, "swept"):
                log.warning("requests on a group member moved to its head", member=m,
                            head=head, requests=n)


async def _move(groups, src: int, head: int, event: str) -> int:
    """Instance `src`'s queued requests to `head`: how many moved (an error is logged)."""
    from shunter.cluster.remote_groups import GroupCommandError

    try:
        n = await move_queued(groups, src, head)
    except (GroupCommandError, EngineDeadError) as exc:
        log.error("queued requests not moved", src=src, head=head, error=str(exc))
        return 0
    if n:
        groups.counters.events.append({"t": anyio.current_time(), "event": event,
                                       "from": src, "to": head, "requests": n})
    return n


async def move_queued(groups, src: int, head: int) -> int:
    moved = await groups._command(src, lambda key: ExportQueued(key=key))
    if not moved:
        return 0
    a, b = groups.instances[src], groups.instances[head]
    for mv in moved:  # their outputs come from the head's link from now on
        live = a._live.pop(mv.cluster_key, None)
        if live is not None:
            b._live[mv.cluster_key] = live
            a.moved_to[mv.cluster_key] = b
    return await groups._command(head, lambda key: AdoptQueued(key=key, moved=tuple(moved)))
