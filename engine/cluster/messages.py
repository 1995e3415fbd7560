"""The coordinator actor's inbox (actors/coordinator.py): typed control messages, no tensors."""

from __future__ import annotations

import attrs

from engine.cluster.dispatch import DispatchRule, InstanceStats, InstanceView
from engine.reply import Reply


@attrs.frozen(kw_only=True)
class ChooseInstance:
    """Pick an instance for a new request; the reply is its index, or a NoInstanceError."""

    demand_tokens: int
    """prompt + max_tokens: the KV the request may come to hold."""
    reply: Reply[int]


@attrs.frozen(kw_only=True)
class RequestEnded:
    instance: int
    demand_tokens: int


@attrs.frozen(kw_only=True)
class StatsReported:
    instance: int
    stats: InstanceStats


@attrs.frozen(kw_only=True)
class InstanceDown:
    instance: int
    reason: str


@attrs.frozen(kw_only=True)
class SetDispatchRule:
    """A replaced policy's dispatch rule, from the next request on."""

    rule: DispatchRule


@attrs.frozen(kw_only=True)
class InspectCluster:
    reply: Reply[tuple[InstanceView, ...]]


@attrs.frozen(kw_only=True)
class CheckOverload:
    """KunServe's global monitor, once per monitor round: the policy's `overload` triggers on
    the cluster's load; the reply is what to do (engine/cluster/overload.py), or None."""

    reply: Reply[object]


@attrs.frozen(kw_only=True)
class GroupsChanged:
    """A group was formed (`formed`) or dissolved (`restored`, by head): new requests for its
    members go to its head while it lasts."""

    formed: object | None = None
    """`engine.cluster.drop_plan.GroupPlan`."""
    restored: int | None = None


@attrs.frozen(kw_only=True)
class SetTriggers:
    """A replaced policy's `overload` triggers, from the next monitor round: a
    `engine.cluster.overload.TriggerFactory`, or None when the new policy has none (running
    groups then dissolve once their requests fit, and nothing drops)."""

    triggers: object | None


CoordinatorMessage = (ChooseInstance | RequestEnded | StatsReported | InstanceDown
                      | SetDispatchRule | InspectCluster | CheckOverload | GroupsChanged
                      | SetTriggers)
