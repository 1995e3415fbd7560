"""KunServe's group commands on the control link (shunter/cluster/wire.py), front door ->
torch instance process, and their one answer. The front door's plan executor
(shunter/cluster/remote_groups.py) sends them; the instance carries them out on its engine and
runner (shunter/cluster/instance_groups.py). Tensors never travel here: the KV exchange, the
activations and the restored weights go over the data plane (gpu/data_plane.py)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class JoinDataPlane:
    """Join the cluster's torch.distributed world as `rank` of `world` (once per process; a
    process that joined already answers with its rank)."""

    key: int
    init: str
    rank: int
    world: int
    timeout_s: float = 60.0


@attrs.frozen(kw_only=True)
class FreePort:
    """Answer a TCP port free on this instance's machine now: instance 0 hosts the data
    plane's rendezvous, on its own address (its peers may be on other machines)."""

    key: int


@attrs.frozen(kw_only=True)
class Moved:
    """One request a member handed over: the scheduler's record (under the member's id), the
    cluster's key for it, and its client stream's state (text so far, stop strings; the stream
    itself is made again at the head)."""

    cluster_key: int
    request: Any
    """`engine.request.Request`."""
    stream: dict


@attrs.frozen(kw_only=True)
class ExportGroup:
    """A member joins the group that instance `head` leads: every live request is handed over
    (the answer: a tuple of `Moved`), and its runner serves the group until the head restores."""

    key: int
    head: int


@attrs.frozen(kw_only=True)
class HeadGroup:
    """Lead `plan` (`engine.cluster.drop_plan.GroupPlan`, this instance first): open the group
    on the runner, take the `adopted` requests (member index in the plan, what it handed over),
    grow the pool; each request runs on once its KV has arrived. The answer: a dict of
    counts."""

    key: int
    plan: Any
    adopted: tuple[tuple[int, Moved], ...]
    microbatch: str = "tokens"
    """How the group cuts its steps (the policy's `microbatch`: `tokens` or `lookahead`)."""
    kv_exchange: str = "coordinated"
    """How the group sends its KV (the policy's `kv_exchange`: `coordinated` or `fifo`)."""
    not_formed: str | None = None
    """The group will not form (why: another member could not join after these handed their
    requests over): take the `adopted` requests to recompute them, and let the members in
    `exported` (waiting for `GroupStart`) serve alone. The answer: the counts."""
    exported: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class GrowGroup:
    """The group this instance leads grows to `plan` (its members first, then the new ones,
    which handed `adopted` over as for `HeadGroup`): gpu/group_grow.py re-splits it. With
    `check`: only whether this plan can grow the group (nothing moves). The answer: a dict of
    counts."""

    key: int
    plan: Any
    adopted: tuple[tuple[int, Moved], ...] = ()
    check: bool = False


@attrs.frozen(kw_only=True)
class ExportQueued:
    """An instance serving alone hands over its queued requests (no KV yet; §4.1: they are
    rescheduled onto a group's enlarged memory). The answer: a tuple of `Moved`."""

    key: int


@attrs.frozen(kw_only=True)
class AdoptQueued:
    """A group's head takes `moved` requests that hold no KV (they are set up here)."""

    key: int
    moved: tuple[Moved, ...]


@attrs.frozen(kw_only=True)
class LeaveGroup:
    """Restore (§4.4): the pool back to the instance's own, every member serving alone."""

    key: int


@attrs.frozen(kw_only=True)
class AskGroupStats:
    key: int


@attrs.frozen(kw_only=True)
class GroupAnswer:
    key: int
    value: Any = None
    error: str | None = None
    too_small: bool = False
    """A restore asked for while the head's requests hold more blocks than its own pool."""


GroupCommand = (JoinDataPlane, ExportGroup, HeadGroup, GrowGroup, LeaveGroup, AskGroupStats,
                ExportQueued, AdoptQueued, FreePort)
