"""The coordinator actor's inbox (actors/coordinator.py): typed control messages, no tensors."""

from __future__ import annotations

from typing import Union

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


CoordinatorMessage = Union[ChooseInstance, RequestEnded, StatsReported, InstanceDown,
                           SetDispatchRule, InspectCluster]
