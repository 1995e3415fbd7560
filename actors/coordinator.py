"""The coordinator actor: the cluster's dispatcher and monitor. It owns the `DispatchTable`
(what it knows of every instance), answers `ChooseInstance` with the policy's dispatch rule,
and keeps the table current from the monitor's `StatsReported`, the front door's
`RequestEnded` and `InstanceDown`. It talks to no instance itself: the front door's instance
handles carry requests and stats (shunter/cluster/)."""

from __future__ import annotations

from typing import assert_never

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream

from engine.cluster.dispatch import DispatchRule, DispatchTable, NoInstanceError
from engine.cluster.drop_plan import GroupPlan
from engine.cluster.messages import (
    CheckOverload,
    ChooseInstance,
    CoordinatorMessage,
    GroupsChanged,
    InspectCluster,
    InstanceDown,
    RequestEnded,
    SetDispatchRule,
    SetTriggers,
    StatsReported,
)
from engine.cluster.overload import Drop, OverloadMonitor, dissolve_only

log = structlog.get_logger(actor="coordinator")


class Coordinator:
    name = "coordinator"

    def __init__(self, *, table: DispatchTable, rule: DispatchRule,
                 inbox: MemoryObjectReceiveStream[CoordinatorMessage],
                 overload: OverloadMonitor | None = None) -> None:
        self.table = table
        self.overload = overload
        """KunServe's global monitor (None: the policy has no overload triggers, or the
        cluster's instances cannot form groups)."""
        self.rule = rule
        """The running policy's dispatch rule (`engine.cluster.dispatch.DISPATCH_RULES`)."""
        self._inbox = inbox
        self._forming: dict[int, int] = {}
        """KunServe: the members of the groups the last `CheckOverload` planned (to form or to
        grow) -> their head. They are redirected from the plan on, before any of them hands its
        requests over, so no new request reaches a member between its export and its serving
        the group (it would run there alone, and its sequence be cleared as the member joins).
        The front door acts on a plan before it asks again: at the next `CheckOverload` the
        redirects that no formed group holds are undone (a plan refused, postponed or not
        acted on)."""

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for msg in self._inbox:
            self.handle(msg)

    def handle(self, msg: CoordinatorMessage) -> None:
        match msg:
            case ChooseInstance(demand_tokens=demand, reply=reply):
                try:
                    index = self.table.choose(self.rule)
                except NoInstanceError as exc:
                    reply.fail(exc)
                    return
                self.table.dispatched(index, demand)
                reply.send(index)
            case RequestEnded(instance=i, demand_tokens=demand):
                self.table.ended(i, demand)
            case StatsReported(instance=i, stats=stats):
                self.table.report(i, stats)
            case InstanceDown(instance=i, reason=reason):
                log.warning("instance down", instance=i, reason=reason)
                self.table.down(i, reason)
            case SetDispatchRule(rule=rule):
                self.rule = rule
            case SetTriggers(triggers=triggers):
                if self.overload is not None:
                    self.overload.replace_triggers(triggers or dissolve_only)
            case InspectCluster(reply=reply):
                reply.send(tuple(self.table.views()))
            case CheckOverload(reply=reply):
                if self.overload is None:
                    reply.send(None)
                    return
                self._undo_forming()
                views = self.table.views()
                action = self.overload.decide(
                    [self.table.stats(v.index) for v in views], [v.alive for v in views],
                    now=anyio.current_time())
                if isinstance(action, Drop):
                    for g in action.new_groups:
                        for m in g.members[1:]:
                            if m not in self.table.redirect:
                                self.table.redirect[m] = self._forming[m] = g.head
                reply.send(action)
            case GroupsChanged(formed=GroupPlan() as group):
                self.overload.formed(group)
                for head, g in list(self.overload.groups.items()):
                    self.table.redirect.update({m: head for m in g.members[1:]})
                self.table.redirect.pop(group.head, None)
            case GroupsChanged(restored=None):
                self.overload.rearm()
            case GroupsChanged(restored=head):
                members = [m for m, h in self.table.redirect.items() if h == head]
                for m in members:
                    del self.table.redirect[m]
                self.overload.restored(head)
            case _:
                assert_never(msg)

    def _undo_forming(self) -> None:
        grouped = {m: h for h, g in self.overload.groups.items() for m in g.members[1:]}
        for m, head in self._forming.items():
            if self.table.redirect.get(m) == head and grouped.get(m) != head:
                del self.table.redirect[m]
        self._forming.clear()
