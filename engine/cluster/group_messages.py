"""KunServe's group messages (engine/cluster/adoption.py, shunter/cluster/groups.py): to a
scheduler (`Regroup`) and a frontend (`HandOverStreams`, `TakeOverStreams`). Part of the
inboxes' unions in engine/messages.py."""

from __future__ import annotations

import attrs

from engine.reply import Reply


@attrs.frozen(kw_only=True)
class HandOverStreams:
    """KunServe group (engine/cluster/adoption.py): give up the client streams of `request_ids`
    (their requests moved to the group's head) without ending them; the reply carries them."""

    request_ids: tuple[int, ...]
    reply: Reply[dict[int, object]]


@attrs.frozen(kw_only=True)
class TakeOverStreams:
    """The head takes streams handed over by a member, under new ids; the reply maps each old
    id to its new one."""

    streams: dict[int, object]
    reply: Reply[dict[int, int]]


@attrs.frozen(kw_only=True)
class Regroup:
    """KunServe groups (engine/cluster/adoption.py), applied between steps: `export` hands every
    live request over (a member joining a group); `adopt` takes requests (the head), their KV
    arriving by `SwapDone`; `pool_blocks` resizes the KV pool; `group` switches the runner
    (a plan of one member: serve alone again). The reply carries the exported requests."""

    export: bool = False
    export_queued: bool = False
    """Hand over only the requests that wait with no KV (never run, or preempted by
    recompute): KunServe reschedules queued requests onto a group with room (§4.1)."""
    adopt: tuple[object, ...] = ()
    """`engine.request.Request`s, already under this engine's ids."""
    adopt_recompute: bool = False
    """The adopted requests' KV is not coming (their group was not formed, so it stayed with,
    or died with, the member that handed them over): each is prefilled again here from its
    whole context, counted as a preemption; a host copy stays with its member."""
    exchange: tuple[int, ...] = ()
    """This engine's own requests whose KV must be exchanged before they run again."""
    recompute: bool = False
    """A member of this engine's group was lost with the KV of its layers (§4.4 fault
    tolerance): every request holding KV on the device is prefilled again (the reply lists
    them); requests swapped to the host keep their copies."""
    pool_blocks: int | None = None
    group: object | None = None
    """`engine.cluster.drop_plan.GroupPlan` or None (unchanged)."""
    reply: Reply[tuple[object, ...]]
