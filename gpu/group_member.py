"""A member instance's part in a pipeline group led by another instance (KunServe §4.1-4.4):
`serve_member` runs on the member's device thread from the moment it handed its requests over
until the head restores, abandons the group, or goes away. The head's side:
gpu/group_runner.py.

Before the group serves, the head may give up on forming it (a plan it cannot run, another
member lost while the group was being started): the member then gets `GroupAbandon` in place of
`GroupStart` or of `GroupGo` (which comes once every member got its `GroupStart`; only then does
a member drop layers and exchange KV) and serves alone again at once, with nothing dropped; the requests it handed over
stay with the head (recomputed there, shunter/cluster/instance_groups.py). A head lost before
its `GroupStart` came ends the member's wait the same way.
"""

from __future__ import annotations

import os

import attrs

from gpu.data_plane import (
    CONTROL_TAG,
    REPLY_TAG,
    GroupMemberLost,
    data_plane,
    fault_point,
    recv_obj,
    send_obj,
)
from gpu.group_grow import await_abandon, regrow_member, take_generators
from gpu.group_messages import (
    GroupAbandon,
    GroupGo,
    GroupRestore,
    GroupStart,
    MemberReply,
    generator_state,
)
from gpu.group_stage import GroupStage
from gpu.kv_exchange import send_transfers
from gpu.pipeline_stage import StageStep
from gpu.restore_kv import restore_transfers, send_kv_prefetch
from gpu.restore_prefetch import (
    PREFETCH_FAULT_ENV,
    GroupPrefetch,
    WeightPrefetch,
    restore_weights,
    stop_prefetch,
)
from gpu.stage_view import restore_layers


def serve_member(solo, head_rank: int) -> dict:
    """A member instance's part in a group (blocking; on its device thread): join when the
    head's `GroupGo` follows its `GroupStart`, run its steps, restore when told. Returns the exchange counters.
    Its runner's own sequences are handed to the group (their KV becomes the adopted
    requests'); afterwards it is solo with no sequences."""
    plane = data_plane()
    start = go = None
    while go is None:  # `GroupStart`, then `GroupGo` once every member got its start
        try:
            msg = recv_obj(head_rank, CONTROL_TAG, "the group was formed")
        except GroupMemberLost as exc:  # the head went away before the group served
            solo._seqs.clear()  # the requests handed over went with it (the front door ends them)
            return {"abandoned": f"head lost before the group formed: {exc}", "formed": False}
        if isinstance(msg, GroupAbandon):  # the head could not form it: nothing was dropped
            solo._seqs.clear()  # the requests handed over are the head's now
            return {"abandoned": f"the group was not formed: {msg.why}", "formed": False}
        if start is None:
            assert isinstance(msg, GroupStart), msg
            start = msg
        else:
            assert isinstance(msg, GroupGo), msg
            go = msg
    me = start.ranks.index(plane.rank)
    if start.held:  # joining a running group that grows
        fault_point("grow-go", plane.rank)
    try:
        stage = GroupStage(solo._model, plane, start, me, solo._seqs)
    except GroupMemberLost as exc:  # a member never opened the group's channel: none started
        solo._seqs.clear()  # the requests handed over are the head's now
        if exc.rank != head_rank:  # the head finds it too and lets every member go
            await_abandon(head_rank, exc)
        if getattr(solo._model, "drop_state", None) is not None:  # it failed after its drop
            restore_layers(solo._model)
        return {"abandoned": f"the group was not formed: {exc}", "formed": False}
    if start.held:
        fault_point("grow-joined", plane.rank)
    take_generators(stage, go.generator_states)  # joining a running group as its last stage
    solo._seqs.clear()
    return serve_stage(stage, start, head_rank)


def serve_stage(stage: GroupStage, start: GroupStart | None, head_rank: int) -> dict:
    """A member's loop once it holds its stage: steps, growths, a merge into another group
    (`GroupHandOver`: gpu/group_merge.py), until the head restores or the group breaks.
    `start` None: the stage is of a group merging into the one `head_rank` leads."""
    from gpu.group_merge import GroupHandOver, merge_into

    if start is None:
        joined = merge_into(stage, head_rank)
        if isinstance(joined, dict):
            return joined
        stage, start = joined
    me = start.ranks.index(data_plane().rank)
    while True:
        try:
            msg = recv_obj(head_rank, CONTROL_TAG, "waiting for the next step")
        except GroupMemberLost as exc:  # the head went away: its requests end with it there
            return _abandon(stage, f"head lost: {exc}")
        if isinstance(msg, GroupAbandon):
            return _abandon(stage, msg.why or f"member instance {msg.lost} lost")
        if isinstance(msg, GroupHandOver):  # its group merges into the one `msg.head` leads
            joined = merge_into(stage, msg.head)
            if isinstance(joined, dict):
                return joined
            (stage, start), head_rank = joined, msg.head
            me = start.ranks.index(data_plane().rank)
            continue
        if isinstance(msg, GroupStart):  # the group grows: a new split (gpu/group_grow.py)
            try:
                grown = regrow_member(stage, msg, head_rank)
            except GroupMemberLost as exc:
                return _abandon(stage, f"lost while the group grew: {exc}")
            if grown is None:
                return _abandon(stage, "the group was abandoned while it grew")
            stage, start = grown, msg
            continue
        if isinstance(msg, GroupPrefetch):  # the restore's weights, written while serving
            start_prefetch(stage, start, me, msg)
            continue
        if isinstance(msg, StageStep):
            try:
                reply = stage.run(msg)
            except GroupMemberLost as exc:
                reply = MemberReply(step_id=msg.step.step_id, error=str(exc), lost=exc.rank)
            except Exception as exc:  # noqa: BLE001 (reported to the head, which fails the step)
                reply = stage.failed_reply(msg.step.step_id, exc)
            try:
                send_obj(reply, head_rank, REPLY_TAG, "answering a step")
            except GroupMemberLost as exc:
                return _abandon(stage, f"head lost: {exc}")
            continue
        assert isinstance(msg, GroupRestore), msg
        for rid in msg.release:
            stage.seqs.pop(rid, None)
        for rid in stage.seqs:  # exchanged KV no step placed yet (it arrived, or arrives, for
            stage._place(rid)  # a request not run since the group formed): read below
        transfers = restore_transfers(stage.seqs, start.layers, msg.skip)
        send_transfers(stage.plane, start.ranks, me, transfers, start.chunk_blocks, 1,
                       lambda t, s=stage, k=msg.skip: s.read_layers(s.seqs[t.request_id].table[
                           k.get(t.request_id, 0):][:t.blocks]), stage.stats)
        restore_weights(stage, start.ranks, start.layers, msg.source)
        stage.end_exchange()
        fault_point("restore-sent", data_plane().rank)  # (tests: lost once all is sent)
        states = ({rid: generator_state(q.generator) for rid, q in stage.seqs.items()
                   if q.generator is not None} if stage.model.last_stage else None)
        send_obj(MemberReply(step_id=-1, generator_states=states), head_rank, REPLY_TAG,
                 "its layers were restored")
        stats = stage.stats
        return {"sent_bytes": stats.sent_bytes, "received_bytes": stats.received_bytes,
                "chunks_sent": stats.chunks_sent, "chunks_received": stats.chunks_received,
                "sent_before_bytes": getattr(stage, "sent_before", 0),
                "copied_blocks": stage.map.copied_blocks,
                "weights_sent": getattr(stage, "weights_sent", 0),
                "prefetch": stage.prefetch.report() if stage.prefetch is not None else None,
                "grown": attrs.asdict(stage.grown) if hasattr(stage, "grown") else None,
                "merged": attrs.asdict(stage.merged) if hasattr(stage, "merged") else None}


def start_prefetch(stage: GroupStage, start: GroupStart, me: int, msg: GroupPrefetch) -> None:
    """A member's part of the restore's prefetch: its first KV round (read before it vacates),
    then its weights (gpu/restore_prefetch.py). An error that is not a loss leaves the group
    serving, each part falling back to the restore's step (the next step's answer tells the
    head): a first round that cannot be gathered goes as zeros of the same shapes, and so does
    every later one (the head posted their receives: the chunks' numbers stay the head's; it
    uses none of its prefetched KV then, `KvPrefetch.abandon`); a member that cannot vacate
    writes its weights from its host copy at the step (`WeightPrefetch.from_host`)."""
    try:
        try:
            if os.environ.get(PREFETCH_FAULT_ENV) == f"kv@{stage.plane.rank}":
                del os.environ[PREFETCH_FAULT_ENV]  # (once)
                raise RuntimeError("the test's fault: its first KV round could not be gathered")
            send_kv_prefetch(stage, start.ranks, me, start.layers, msg.kv_blocks,
                             start.chunk_blocks)
        except GroupMemberLost:
            raise
        except Exception as exc:  # (the real round sends all of its chunks or none)
            stage.kv_void = f"{type(exc).__name__}: {exc}"
            send_kv_prefetch(stage, start.ranks, me, start.layers, msg.kv_blocks,
                             start.chunk_blocks, placeholder=True)
        stage.prefetch = WeightPrefetch(stage, start.ranks, start.layers, msg)
    except Exception as exc:  # noqa: BLE001 (a loss, or vacated part-way: the next step's
        stage.prefetch_failed = exc  # answer raises it)


def _abandon(stage: GroupStage, why: str) -> dict:
    """A member leaves a broken group: its dropped layers from its host copy, no sequences."""
    stage.plane.close(broken=True)  # nothing left on the group's channel matches anything
    stop_prefetch(stage)  # (its receives ended with the channel) before the host copy
    restore_layers(stage.model)
    return {"abandoned": why}
