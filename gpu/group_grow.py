"""A running pipeline group grows (KunServe §4.1: Algorithm 6 merges a group that cannot hold
its queued demand with the smallest other group; here the other group is an instance serving
alone). The group (head A, members B, ...) takes instance C: the plan's layer split
(engine/cluster/plan.py `stage_layers`) over A, B, ..., C, in that order (the running head
stays the head, the new members come last).

Every old member re-splits: it reads the KV it holds of every live request (its old layers)
to the host and sends the layers another member keeps now over the data plane (the exchange of
group formation, activations first, on the grown group's own channel), changes the layers it
keeps (`redrop_layers`: only the layers it gains come in, from the first new member over the
channel (it holds every layer until it joins: `GroupStart.gain_from`; `PEER_GAINS` False: from
its host copy), and only those it drops now go to the host; its host copy of the others stays as
it is), views its arena again for its new range (new stage view and block map) and leaves the
KV of the layers it keeps where it lies: each group block id is pinned to the new view's block
over it (gpu/kept_kv.py; one the layout gives no such block is copied on the device into a
fresh one). The new member C joins as a member joins a forming group
(gpu/group_member.py), receiving its layers of every request from those that held them, and
sends its own requests' KV as formation does. Requests stay alive: their tables (the group's
block ids) do not change, the pool only grows, and a request waits only for its own chunks.
Costs (counted in `GrowStats`): the weights a member gains or drops, and a device copy of the
kept KV of each block that cannot stay in place (`kv_local_copied`; none when the new stride
divides the old one and no gained weights lie over it).

The protocol: the head sends every member (old and new) the new `GroupStart` (with `held`: the
layers each member holds now); each old member answers with the seeded generators it sampled
with (the last stage moves to C); the head then sends `GroupGo` carrying those generators, and
everyone re-splits. The head refuses to grow while the group's previous exchange has not
settled (a request still waiting for its KV, or adopted and not yet set up): the caller tries
later. A member lost meanwhile: the head recovers from its host copy in the same call and lets
every member go (`KunServeTorchRunner.grow`); a member that finds the loss waits for that
`GroupAbandon` (`await_abandon`).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

import attrs
import torch

from gpu.block_map import BlockMap
from gpu.data_plane import (
    CONTROL_TAG,
    REPLY_TAG,
    WEIGHTS_TAG,
    GroupMemberLost,
    data_plane,
    fault_point,
    new_channel_key,
    open_channel,
    recv_obj,
    send_obj,
)
from gpu.group_messages import (
    Adopted,
    GroupAbandon,
    GroupGo,
    GroupStart,
    MemberReply,
    SeqState,
    generator_state,
    restored_generator,
    start_transfers,
)
from gpu.group_stage import GroupStage, _Seq
from gpu.kv_exchange import send_transfers
from gpu.kept_kv import KeptKV
from gpu.kv_moved import count_moved, transfer_bytes
from gpu.stage_view import group_pool_blocks, redrop_layers  # noqa: F401 (tests import it here)

GROW_EPOCH = 2
"""First tag epoch of a growth's exchange (0: forming, 1: restoring)."""
PEER_GAINS = True
"""The layers an old member gains come from the first new member over the grown group's
channel (it holds every layer until it joins); False: from each one's host copy."""


class NotSettled(RuntimeError):
    """The group's previous exchange is still running: it cannot grow now (try later)."""


@attrs.define
class GrowStats:
    """What one member's re-split copied (bytes)."""

    weights_restored: int = 0
    """Dropped weights copied back from the host copy."""
    weights_from_peer: int = 0
    """Gained weights received from a new member (`GroupStart.gain_from`)."""
    weights_saved: int = 0
    """Newly dropped weights copied to the host (the next restore's copy)."""
    kv_local: int = 0
    """KV of the layers this member keeps of those it held (gpu/kept_kv.py)."""
    kv_local_copied: int = 0
    """Of it, what was copied into other blocks (the rest stayed where it lay: no copy)."""
    kv_sent: int = 0
    kv_received: int = 0
    """KV over the data plane (received: counted by the receiver as chunks come in; this is
    the total due)."""
    seconds: float = 0.0
    """The head's re-split, wall time (its own stage; not waiting for its chunks)."""
    kv_adopted: int = 0
    """The adopted requests' KV due over the data plane, to every member (the head's count)."""
    kv_adopted_held: int = 0
    """All of their KV, every layer (what a move of each byte once at most is measured by)."""


class ResplitStage(GroupStage):
    """An old member's stage after the group grew: built from its previous stage (not from a
    solo model), keeping `start.layers[me]`."""

    def __init__(self, old: GroupStage, start: GroupStart, me: int) -> None:
        model = old.model
        for rid in list(old.seqs):  # every chunk of the last exchange in its blocks first
            old._place(rid)
        old.plane.queue.flush()  # and every chunk it sent taken: the old channel is done
        old.plane.close()
        plane = open_channel(data_plane(), start.channel, start.ranks)  # the grown group's
        self.model, self.plane, self.start, self.me = model, plane, start, me
        arena = model.arena
        self.block_size = arena.block_size
        self.keep = start.layers[me]
        self.stats = old.stats  # the group's counters go on
        self.grown = GrowStats()
        transfers = start_transfers(start, self.block_size)
        tables = {s.request_id: list(s.table) for s in start.seqs}
        was = old.keep

        def held(table: Sequence[int], layers: range) -> torch.Tensor:
            return old.read_layers(table)[:, layers.start - was.start:layers.stop - was.start]

        plane.queue.fifo = start.kv_exchange == "fifo"
        sent = self.stats.sent_bytes
        send_transfers(plane, start.ranks, me, transfers, start.chunk_blocks, start.epoch,
                       lambda t: held(tables[t.request_id][:t.blocks], t.layers), self.stats)
        self.grown.kv_sent = self.stats.sent_bytes - sent
        ids = list(dict.fromkeys(g for s in start.seqs for g in s.table))
        kept = KeptKV(model, self.keep, [old.map.local(g) for g in ids])  # (before the re-split)
        fill = None
        if start.gain_from >= 0:  # the layers gained, from the new member holding every one
            src = start.ranks[start.gain_from]

            def fill(blocks: range, dst: torch.Tensor) -> None:
                plane.recv_tensor(dst, src, WEIGHTS_TAG, "its gained layers were being sent")
                self.grown.weights_from_peer += dst.numel() * dst.element_size()

        self.drop, self.grown.weights_restored, self.grown.weights_saved = redrop_layers(
            model, self.keep, fill)
        self.map = BlockMap(self.drop.view, start.group)
        copies = []  # the kept KV stays where it lies, its group ids pinned there, or is copied
        for g in ids:
            if (j := kept.place(old.map.local(g))) is not None:
                self.map.pin(g, j)
            elif len(kept.stay):
                copies.append(g)
        self.seqs = {}
        for s in start.seqs:
            prev = old.seqs.get(s.request_id)
            seq = _Seq(tokens=list(s.tokens), table=list(s.table), sampling=s.sampling,
                       generator=None if prev is None else prev.generator)
            self.seqs[s.request_id] = seq
            for i, g in enumerate(s.table):
                self.map.assign(s.request_id, i, g)
        for g in copies:
            kept.write_copy(model, old.map.local(g), self.map.local(g))
        kept.done()
        self.grown.kv_local = kept.in_place_bytes + kept.copied_bytes
        self.grown.kv_local_copied = kept.copied_bytes
        self._owned_gens = {}
        mine = [t for t in transfers if t.dst == me]
        self.grown.kv_received = sum(
            t.blocks * len(t.layers) * 2 * self.block_size * model.config.num_kv_heads
            * model.config.head_dim * arena.buffer.element_size() for t in mine)
        self.receiver = self._kv_receiver(transfers)
        self._hidden = model.config.hidden_size


def await_abandon(head_rank: int, exc: GroupMemberLost) -> None:
    """A member that found another lost while the group grew waits for the head's
    `GroupAbandon` (the head finds the loss too; left unread, the head's send of it hangs until
    gloo's timeout), answering any step sent before it with the loss (the head then finds it)."""
    from gpu.pipeline_stage import StageStep

    try:
        while not isinstance(msg := recv_obj(head_rank, CONTROL_TAG, "the group was growing"),
                             GroupAbandon):
            if isinstance(msg, StageStep):
                send_obj(MemberReply(step_id=msg.step.step_id, error=str(exc), lost=exc.rank),
                         head_rank, REPLY_TAG, "answering a step")
    except GroupMemberLost:  # the head is gone as well
        pass


def take_generators(stage: GroupStage, states) -> None:
    """The last stage samples: the seeded generators of the member that sampled before go on
    here."""
    if not states or not stage.model.last_stage:
        return
    for rid, state in (states or {}).items():
        seq = stage.seqs.get(rid)
        if seq is not None:
            seq.generator = restored_generator(seq.sampling, rid, stage.model.arena.device,
                                               state)


def regrow_member(stage: GroupStage, start: GroupStart, head_rank: int) -> GroupStage | None:
    """An old member's part (in `serve_member`'s loop, on its device thread): answer with the
    generators it sampled with, then re-split at `GroupGo`. None: the head abandoned the
    group instead (the caller leaves it)."""
    states = ({rid: generator_state(q.generator) for rid, q in stage.seqs.items()
               if q.generator is not None} if stage.model.last_stage else None)
    send_obj(MemberReply(step_id=-1, generator_states=states), head_rank, REPLY_TAG,
             "the group was growing")
    go = recv_obj(head_rank, CONTROL_TAG, "the group was growing")
    if isinstance(go, GroupAbandon):
        return None
    assert isinstance(go, GroupGo), go
    fault_point("grow-go", stage.plane.rank)
    try:
        new = ResplitStage(stage, start, start.ranks.index(stage.plane.rank))
    except GroupMemberLost as exc:  # another member is gone: the head lets every member go
        if exc.rank != head_rank:
            await_abandon(head_rank, exc)
        raise
    take_generators(new, go.generator_states)
    return new


def _start_all(start: GroupStart, old_ranks: Sequence[int]) -> dict:
    """Send every member its `GroupStart` and take the old members' generators. A member lost
    meanwhile raises `GroupMemberLost` once every old member that got its start has answered:
    an answer left unread would be taken, on the world, for the answer to the next group's
    first step between the same two instances."""
    got, lost = [], None
    for rank in start.ranks[1:]:
        try:
            send_obj(start, rank, CONTROL_TAG, "the group was growing")
        except GroupMemberLost as exc:
            lost = exc
            break
        got.append(rank)
    states: dict = {}
    for rank in old_ranks[1:]:
        if rank in got:
            try:
                reply: MemberReply = recv_obj(rank, REPLY_TAG, "the group was growing")
            except GroupMemberLost as exc:
                lost = lost or exc
                continue
            states.update(reply.generator_states or {})
    if lost is not None:
        raise lost
    return states


def grown_plan(ranks: Sequence[int], old_ranks: Sequence[int]) -> tuple[int, ...]:
    """The grown group's pipeline order: the running group's, then the new members by index."""
    new = sorted(set(ranks) - set(old_ranks))
    if not set(old_ranks) <= set(ranks) or not new:
        raise ValueError(f"group {tuple(ranks)} does not grow group {tuple(old_ranks)}")
    return tuple(old_ranks) + tuple(new)


def unsettled(group, live: Collection[int] | None) -> set[int]:
    """Requests of `group` (a GroupRunner) whose KV is still moving: waiting for chunks on
    some member, or adopted and never set up yet (their KV is in a receiver's staging or
    reserved on their owner, not in blocks every member maps; one set up and since released
    to be recomputed holds none). `live`: the engine's live request ids (None: all count)."""
    pending = set(group.exchanging()) | {a.request_id for a in group.adopted
                                         if a.request_id not in group.stage.seqs
                                         and a.request_id not in group.set_up}
    return pending if live is None else pending & set(live)


def check_grow(group, plan) -> range:
    """The grown pool's block ids if `plan` can grow `group` (a GroupRunner): its members
    first, a valid split, and a pool larger than the group's (an uneven split whose largest
    stage keeps as many layers as before frees nothing: 4 layers in 3 stages keep 2 | 1 | 1).
    Raises ValueError otherwise."""
    from gpu.group_runner import check_plan

    arena = group.stage.model.arena
    ranks, layers = tuple(plan.members), tuple(plan.layers)
    n_old = len(group.ranks)
    if ranks[:n_old] != group.ranks or len(ranks) <= n_old:
        raise ValueError(f"plan {ranks} does not grow group {group.ranks} (its members first)")
    check_plan(ranks, layers, group.stage.model.config.num_layers)
    pool = range(arena.weight_blocks, arena.weight_blocks + group_pool_blocks(
        group.stage.model.config, arena.block_size, arena.dtype, arena.total_blocks, layers))
    if len(pool) <= len(group.pool):
        raise ValueError(f"the grown group's pool of {len(pool)} blocks is not larger than the "
                         f"group's {len(group.pool)} (split {[len(r) for r in layers]})")
    return pool


def grow_group(group, plan, adopted: Sequence[Adopted], *, fits, live=None,
               ) -> tuple[range, tuple[int, ...]]:
    """On the head's device thread: `group` (a GroupRunner) grows to `plan`, whose members
    are the group's in order, then the new ones, which handed `adopted` over. Returns the
    grown pool's block ids and the live requests whose KV moves (each gets its arrival).
    Raises `NotSettled` (nothing sent) while the last exchange runs."""
    stage = group.stage
    ranks, layers = tuple(plan.members), tuple(plan.layers)
    n_old = len(group.ranks)
    pool = check_grow(group, plan)
    waiting = unsettled(group, live)
    if waiting:
        raise NotSettled(f"requests {sorted(waiting)} still wait for the group's last KV "
                         f"exchange")
    for t in group._fed_back:  # the head is not the last stage: tokens it has not appended
        if t.request_id in stage.seqs:
            stage.seqs[t.request_id].tokens.append(t.token_id)
    group._fed_back = ()
    group.grows = getattr(group, "grows", 0) + 1
    start = GroupStart(
        ranks=ranks, layers=layers, group=pool, adopted=tuple(adopted),
        seqs=tuple(SeqState(request_id=rid, tokens=tuple(s.tokens), table=tuple(s.table),
                            sampling=s.sampling) for rid, s in stage.seqs.items()),
        chunk_blocks=group.chunk_blocks, microbatches=2 * len(ranks),
        kv_exchange=group.kv_exchange, held=group.layers + (range(0),) * (len(ranks) - n_old),
        epoch=GROW_EPOCH + (group.grows - 1) % 14, channel=new_channel_key(data_plane()),
        gain_from=n_old if PEER_GAINS and not any(a.parts for a in adopted) else -1)
    states = _start_all(start, group.ranks)
    for rank in ranks[1:]:
        send_obj(GroupGo(generator_states=states), rank, CONTROL_TAG, "the group was growing")
    began = time.perf_counter()
    new = ResplitStage(stage, start, 0)
    new.grown.seconds = time.perf_counter() - began
    group.stage, group.ranks, group.layers, group.pool = new, ranks, layers, pool
    group.adopted, group.fits, group.microbatches = tuple(adopted), fits, 2 * len(ranks)
    group.exchange = new.stats
    group._expect, group._ready = {}, []
    transfers = start_transfers(start, new.block_size)
    count_moved(group.solo, transfer_bytes(transfers, stage.model, new.block_size))
    for t in transfers:
        group._expect.setdefault(t.request_id, set()).add(t.dst)
    group._ready = [a.request_id for a in adopted if a.request_id not in group._expect]
    group._note_arrived(0, new.receiver.take_arrived())
    group.grow_stats = new.grown
    c, mine = stage.model.config, {a.request_id for a in adopted}
    per = 2 * new.block_size * c.num_kv_heads * c.head_dim * stage.model.arena.buffer.element_size()
    new.grown.kv_adopted = sum(t.blocks * len(t.layers) * per for t in transfers
                               if t.request_id in mine)  # (a block of one layer: `per` bytes)
    new.grown.kv_adopted_held = sum(-(-a.kv_tokens // new.block_size) * c.num_layers * per
                                    for a in adopted)
    own = tuple(sorted({t.request_id for t in transfers if t.request_id in new.seqs}))
    return pool, own
