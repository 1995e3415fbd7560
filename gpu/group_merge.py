"""Two running pipeline groups merge without restoring the joining one first (KunServe §4.1:
Algorithm 6 merges the smallest groups, which may be groups already; §4.2: the KV of requests
in flight moves in chunks behind the activations). Group A (head H) stays; group B (head J)
joins. J's scheduler hands B's requests over to H (their KV stays where B's members hold it);
J tells B's members that their head is H now (`GroupHandOver`); then every member of B, J
included, joins A's growth as a new member (gpu/group_grow.py: the layers split again over A's
members, then B's, in order). H adopts B's requests with `Adopted.parts`: which member of the
merged group holds which layers of them. At `GroupGo` each member of B sends the layers of B's
requests it holds to the members that keep them now (the coordinated exchange: chunks,
activations first), changes its layers (`redrop_layers`, the ones it gains from its host copy)
and leaves the KV of the layers it keeps where it lies: each such block is reserved in its new
stage view for the request, whose table (the merged head's block ids) comes with its first
step (gpu/kept_kv.py; a block the layout gives no place in the new view is copied on the
device into a fresh one, reserved alike). Each byte of B's KV thus moves at most once, and
the kept bytes not at all where the layout allows; the restore-then-grow path moved B's
members' layers to J, then out again.

A member lost meanwhile: H recovers as in any growth (every request recomputed at H), every
survivor restores its dropped layers from its host copy and serves alone.
"""

from __future__ import annotations

import attrs
import torch

from gpu.block_map import BlockMap
from gpu.data_plane import (
    CONTROL_TAG,
    GroupMemberLost,
    data_plane,
    fault_point,
    open_channel,
    recv_obj,
    send_obj,
)
from gpu.group_gens import hand_generators
from gpu.group_grow import await_abandon, take_generators
from gpu.group_messages import GroupAbandon, GroupGo, GroupStart, start_transfers
from gpu.group_stage import GroupStage, _Seq
from gpu.kept_kv import KeptKV
from gpu.kv_exchange import ExchangeStats, send_transfers
from gpu.stage_view import redrop_layers, restore_layers


@attrs.frozen(kw_only=True)
class GroupHandOver:
    """From a joining group's head to its members: the group merges into the one instance
    `head` leads; its `GroupStart`, then `GroupGo` (or `GroupAbandon`), come from there."""

    head: int


@attrs.define
class MergeStats:
    """What one member of the joining group moved as the groups merged (bytes)."""

    requests: int = 0
    """The joining group's requests it held KV of."""
    kv_sent: int = 0
    """Their KV sent to the members keeping those layers now."""
    kv_kept: int = 0
    """Their KV of the layers it keeps (gpu/kept_kv.py)."""
    kv_kept_copied: int = 0
    """Of it, what was copied into other blocks (the rest stayed where it lay: no copy)."""
    weights_restored: int = 0
    weights_saved: int = 0


class MergeStage(GroupStage):
    """A joining group's member in the merged group: built from its stage in the joining group
    (`old`), keeping `start.layers[me]`. The staying group's requests are new here (their KV
    comes from its members); the joining group's are adopted (`Adopted.parts`)."""

    def __init__(self, old: GroupStage, start: GroupStart, me: int) -> None:
        for rid in list(old.seqs):  # every chunk of its last exchange in its blocks first
            old._place(rid)
        old.plane.queue.flush()
        old.plane.close()
        plane = open_channel(data_plane(), start.channel, start.ranks)  # the merged group's
        try:
            self._merge(old, plane, start, me)
        except BaseException:
            plane.close(broken=True)
            raise

    def _merge(self, old: GroupStage, plane, start: GroupStart, me: int) -> None:
        model = old.model
        self.model, self.plane, self.start, self.me = model, plane, start, me
        self.block_size = model.arena.block_size
        self.keep, was = start.layers[me], old.keep
        self.stats, self.merged = ExchangeStats(), MergeStats()
        self.sent_before = old.stats.sent_bytes + getattr(old, "sent_before", 0)
        """KV bytes it sent in the joining group (and in groups that merged before)."""
        handed = {a.request_id: a for a in start.adopted
                  if a.parts and a.old_request_id in old.seqs and a.kv_tokens}
        transfers = start_transfers(start, self.block_size)

        read: dict[int, torch.Tensor] = {}  # request -> its blocks' KV of every layer held

        def held(rid: int, blocks: int, layers: range) -> torch.Tensor:
            if rid not in read:
                read[rid] = old.read_layers(old.seqs[handed[rid].old_request_id].table[:blocks])
            return read[rid][:, layers.start - was.start:layers.stop - was.start]

        plane.queue.fifo = start.kv_exchange == "fifo"
        gens = hand_generators(plane, start, me, {}, model.arena.device)  # (the last stage:
        # those of the requests instances alone handed over, as the merged group grew by them)
        send_transfers(plane, start.ranks, me, transfers, start.chunk_blocks, start.epoch,
                       lambda t: held(t.request_id, t.blocks, t.layers), self.stats)
        self.merged.kv_sent, self.merged.requests = self.stats.sent_bytes, len(handed)
        read.clear()
        olds = {rid: old.map.locals(old.seqs[a.old_request_id].table[
            :-(-a.kv_tokens // self.block_size)]) for rid, a in handed.items()}
        kept = KeptKV(model, self.keep, [b for blocks in olds.values() for b in blocks])
        self.drop, self.merged.weights_restored, self.merged.weights_saved = redrop_layers(
            model, self.keep)
        self.map = BlockMap(self.drop.view, start.group)
        if len(kept.stay):  # their kept layers: reserved where they lie, for when tables come
            for rid, blocks in olds.items():
                self.map.reserve(rid, [kept.place(b) for b in blocks])
        self.seqs = {}
        for s in start.seqs:  # the staying group's requests: all of their KV comes here
            self.seqs[s.request_id] = _Seq(tokens=list(s.tokens), table=list(s.table),
                                           sampling=s.sampling, generator=None)
            for i, g in enumerate(s.table):
                self.map.assign(s.request_id, i, g)
        for rid, blocks in olds.items():  # where the layout allowed no block in place: copied
            for i, j in self.map.fresh(rid):
                kept.write_copy(model, blocks[i], j)
        kept.done()
        self.merged.kv_kept = kept.in_place_bytes + kept.copied_bytes
        self.merged.kv_kept_copied = kept.copied_bytes
        self._owned_gens = {rid: old.seqs[a.old_request_id].generator
                            for rid, a in handed.items()} | gens
        self.receiver = self._kv_receiver(transfers)
        self._hidden = model.config.hidden_size


def join_merged(stage: GroupStage, head_rank: int) -> tuple[MergeStage, GroupStart] | None:
    """A joining group's member (its head included; on its device thread): wait for the
    merged group's `GroupStart` and `GroupGo` from instance `head_rank`, then re-split. None:
    the head abandoned the merge first. A member lost while it re-splits: `GroupMemberLost`
    once the head's `GroupAbandon` was read (unread, the head's send of it hangs)."""
    rank = data_plane().rank
    start = recv_obj(head_rank, CONTROL_TAG, "the groups were merging")
    if isinstance(start, GroupAbandon):
        return None
    assert isinstance(start, GroupStart), start
    go = recv_obj(head_rank, CONTROL_TAG, "the groups were merging")
    if isinstance(go, GroupAbandon):
        return None
    assert isinstance(go, GroupGo), go
    fault_point("grow-go", rank)
    try:
        new = MergeStage(stage, start, start.ranks.index(rank))
    except GroupMemberLost as exc:
        if exc.rank != head_rank:
            await_abandon(head_rank, exc)
        raise
    fault_point("grow-joined", rank)
    take_generators(new, go.generator_states)
    return new, start


def merge_into(stage: GroupStage, head_rank: int) -> tuple[MergeStage, GroupStart] | dict:
    """`join_merged`, or the member's final answer when the merge broke: it serves alone
    again, its dropped layers from its host copy (the head recomputes every request)."""
    try:
        joined = join_merged(stage, head_rank)
    except GroupMemberLost as exc:
        why = f"lost while the groups merged: {exc}"
    else:
        if joined is not None:
            return joined
        why = "the merge was abandoned"
    if getattr(stage.model, "drop_state", None) is not None:
        restore_layers(stage.model)
    stage.plane.close(broken=True)
    return {"abandoned": why}


def hand_over_group(runner, head_rank: int) -> dict:
    """The joining group's head, on its device thread, once its scheduler handed every request
    over: it leads no group now; its members are told the new head; then it serves the merged
    group as a member (gpu/group_member.py `serve_stage`) until that restores. A member that
    cannot be told is the merged head's to find (its `GroupStart` fails)."""
    from gpu.group_member import serve_stage

    group, runner.group = runner.group, None
    runner.last_group, runner.last_ended = group, "merged"
    try:
        for rank in group.ranks[1:]:
            try:
                send_obj(GroupHandOver(head=head_rank), rank, CONTROL_TAG,
                         "the groups were merging")
            except GroupMemberLost:
                pass
        return serve_stage(group.stage, None, head_rank)
    finally:
        runner._seqs.clear()
        runner.handing_over = False
