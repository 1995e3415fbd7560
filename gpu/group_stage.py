"""One member's part of a pipeline group formed at run time (KunServe §4.1-4.2): its model with
the other members' layers dropped (gpu/stage_view.py), its block map, the group's sequences,
and the KV exchange in both directions. Every member runs this class; the head's runner
(gpu/group_runner.py) drives it and sends the others their control messages.

Forming the group: every member gathers the KV it must send (its own requests' KV for the other
members' layers: from the old full-layout blocks, before anything overwrites them), drops its
layers, maps the blocks that already hold its layers of a request's KV, and starts receiving.
A request whose KV is still arriving is placed into its blocks the first time a step includes
it, after waiting for exactly its own chunks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import attrs
import torch

from engine.cluster.plan import split_microbatches
from engine.cluster.stage_fits import Cut, pieces
from engine.messages import ExecuteStep, SampledToken, SeqWork
from engine.params import SamplingParams
from gpu.block_map import BlockMap
from gpu.data_plane import Channel, DataPlane, GroupMemberLost, open_channel
from gpu.group_gens import hand_generators
from gpu.kv_exchange import ExchangeStats, KvReceiver, KvTransfer, WatchedRecv, send_transfers
from gpu.metadata import build_step_inputs
from gpu.pipeline_stage import StageStep, sample_work
from gpu.pipeline_stage import _tag as activation_tag
from gpu.restore_prefetch import prefetch_state
from gpu.sampler import make_generator
from gpu.stage_view import drop_layers, send_gained


@attrs.frozen(kw_only=True)
class SeqState:
    """A request of the head as the group starts: its tokens and table (group block ids)."""

    request_id: int
    tokens: tuple[int, ...]
    table: tuple[int, ...]
    sampling: SamplingParams
    generator_state: bytes | None = None
    """Its sampling generator's state (seeded sampling goes on where it was, on the member
    that samples)."""


def generator_state(gen: torch.Generator | None) -> bytes | None:
    return None if gen is None else gen.get_state().numpy().tobytes()


def restored_generator(sampling: SamplingParams, request_id: int, device,
                       state: bytes | None) -> torch.Generator | None:
    gen = make_generator(sampling, fallback_seed=request_id, device=device)
    if gen is not None and state is not None:
        gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return gen


@attrs.frozen(kw_only=True)
class Adopted:
    """A request that moved to the head from member `owner`, whose KV lies there."""

    request_id: int
    """Its id on the head."""
    owner: int
    """Member index (pipeline order)."""
    old_request_id: int
    """Its id on the owner's runner."""
    kv_tokens: int
    """Tokens whose KV the owner holds."""
    parts: tuple[tuple[int, range], ...] = ()
    """A running group merging into this one hands its requests over from its members
    (gpu/group_merge.py): (member index here, the layers it holds); (): the owner holds all."""


@attrs.frozen(kw_only=True)
class GroupStart:
    ranks: tuple[int, ...]
    """Data-plane rank of each member, pipeline order; ranks[0] is the head."""
    layers: tuple[range, ...]
    group: range
    """The group's block ids."""
    seqs: tuple[SeqState, ...]
    adopted: tuple[Adopted, ...]
    chunk_blocks: int
    microbatches: int
    kv_exchange: str = "coordinated"
    """The policy's `kv_exchange`: `fifo` sends every member's KV chunks and activations in
    one queue, in order (gpu/transfer.py `TransferQueue.fifo`), for the group's life."""
    held: tuple[range, ...] = ()
    """A running group grows (gpu/group_grow.py): the layers whose KV of every request in
    `seqs` member k holds now (empty for a member joining); () when a group forms: the head
    holds all of its requests' layers."""
    gain_from: int = -1
    """A growth: the new member (it holds every layer) that sends each old member the layers
    it gains before it drops its own (`send_gained`); -1: each from its host copy."""
    epoch: int = 0
    """The exchange's tag epoch (gpu/kv_exchange.py): 0 forming, 1 restoring, 2+ growing."""
    channel: str = ""
    """The key of the group's own channel (gpu/data_plane.py `open_channel`; the head makes it
    with `new_channel_key`): every tensor of the group goes over it, never over the world."""


@attrs.frozen(kw_only=True)
class GroupStep(StageStep):
    """A group's step with the head's cut of it into microbatches (engine/cluster/stage_fits.py:
    by tokens, or lookahead's cost-balanced pieces); every member runs exactly this cut."""

    micro: Cut


@attrs.frozen(kw_only=True)
class GroupRestore:  # the head to every member: solo again (gpu/restore_kv.py)
    tables: Mapping[int, tuple[int, ...]]
    """Each live request's solo table on the head."""
    source: str
    """'peer' (dropped weights from the members keeping them) or 'host' (each one's copy)."""
    release: tuple[int, ...] = ()
    """Requests that ended since the last step (dropped before anything moves)."""
    skip: Mapping[int, int] = attrs.field(factory=dict)
    """Request -> its first blocks, whose KV moved before (gpu/restore_kv.py)."""


@attrs.frozen(kw_only=True)
class MemberReply:
    step_id: int
    sampled: tuple[SampledToken, ...] = ()
    compute_s: tuple[float, ...] = ()
    cpu_s: tuple[float, ...] = ()
    """Per microbatch: the stage thread's CPU seconds in its layers, when it computes on the
    CPU with one thread (what it would take with a core of its own: the processes of a group
    on one host share its cores); empty otherwise."""
    wait_s: tuple[float, ...] = ()
    arrived: tuple[int, ...] = ()
    error: str | None = None
    lost: int | None = None
    """The rank of a member this one lost contact with while running the step."""
    generator_states: Mapping[int, bytes] | None = None
    """At restore, from the last member (which sampled): each seeded request's generator."""
    prefetched: bool | None = None
    """Whether its prefetched weights are in (gpu/restore_prefetch.py); None: no prefetch."""


@attrs.frozen(kw_only=True)
class GroupGo:
    """Every member got its `GroupStart`: start (drop layers, exchange KV). Sent only once all
    did, so a member that cannot be reached leaves none of the others started (a started one
    would have queued its exchange with the head, which the head then never takes)."""

    generator_states: Mapping[int, bytes] | None = None
    """A growth (gpu/group_grow.py): the last stage's seeded generators, for the new one."""


@attrs.frozen(kw_only=True)
class GroupAbandon:
    """A member was lost, or the group could not be formed: every survivor restores its
    dropped layers from its host copy (a member still waiting for `GroupStart` has dropped
    nothing) and serves alone, empty (the head recomputes the requests)."""

    lost: int  # the lost member's rank; -1: none was (the head gave up forming the group)
    why: str = ""


@attrs.define(slots=True, eq=False)
class _Seq:
    tokens: list[int]
    table: list[int]
    sampling: SamplingParams
    generator: torch.Generator | None


def start_transfers(start: GroupStart, block_size: int) -> list[KvTransfer]:
    """Every KV transfer forming the group needs: each request's KV for every other member's
    layers, from the member holding it."""
    out, n = [], len(start.ranks)
    for s in start.seqs:  # the head's own requests: all of their table (if any)
        if start.held:  # a group grows: each member's new layers from those that hold them
            out += [KvTransfer(request_id=s.request_id, src=j, dst=k, layers=part,
                               blocks=len(s.table)) for k in range(n)
                    for j, h in enumerate(start.held) if j != k and s.table
                    and len(part := overlap(h, start.layers[k]))]
            continue
        out += [KvTransfer(request_id=s.request_id, src=0, dst=k, layers=start.layers[k],
                           blocks=len(s.table)) for k in range(1, n) if s.table]
    for a in start.adopted:  # from the owner (every layer), or from each member of `parts`
        blocks = -(-a.kv_tokens // block_size)
        held = a.parts or ((a.owner, range(start.layers[0].start, start.layers[-1].stop)),)
        out += [KvTransfer(request_id=a.request_id, src=j, dst=k, layers=part, blocks=blocks)
                for k in range(n) for j, h in held
                if j != k and blocks and len(part := overlap(h, start.layers[k]))]
    return out


def overlap(a: range, b: range) -> range:
    """The layers both contiguous ranges hold."""
    return range(max(a.start, b.start), max(max(a.start, b.start), min(a.stop, b.stop)))


class GroupStage:
    def __init__(self, model, plane: DataPlane, start: GroupStart, me: int,
                 owned: Mapping[int, object], generators: Mapping[int, torch.Generator | None]
                 = {}) -> None:
        """`owned`: this member's solo sequences (old request id -> an object with `.table`),
        whose KV the adopted requests it owned still hold. Opens the group's channel first
        (every member does: it blocks until all did); `self.plane` is that channel."""
        link = open_channel(plane, start.channel, start.ranks)
        try:
            self._build(model, link, start, me, owned, generators)
        except BaseException:
            link.close(broken=True)
            raise

    def _build(self, model, plane: Channel, start: GroupStart, me: int,
               owned: Mapping[int, object], generators: Mapping[int, torch.Generator | None]
               ) -> None:
        self.model, self.plane, self.start, self.me = model, plane, start, me
        arena = model.arena
        self.block_size = arena.block_size
        self.keep = start.layers[me]
        self.stats = ExchangeStats()
        transfers = start_transfers(start, self.block_size)
        old = {s.request_id: list(s.table) for s in start.seqs}
        old.update({a.request_id: list(owned[a.old_request_id].table)
                    for a in start.adopted if a.owner == me})

        def gather(t: KvTransfer) -> torch.Tensor:  # the old full-layout blocks, all layers
            idx = torch.tensor(old[t.request_id][:t.blocks], device=arena.device)
            return arena.kv[idx][:, t.layers.start:t.layers.stop].to("cpu")

        plane.queue.fifo = start.kv_exchange == "fifo"
        self._owned_gens = {a.request_id: owned[a.old_request_id].generator
                            for a in start.adopted if a.owner == me}
        """Its adopted requests' generators, or their owners' (gpu/group_gens.py) if last."""
        self._owned_gens.update(hand_generators(plane, start, me, self._owned_gens,
                                                arena.device))
        self.weights_sent = send_gained(plane, model, start) if me == start.gain_from else 0
        send_transfers(plane, start.ranks, me, transfers, start.chunk_blocks, start.epoch,
                       gather, self.stats)
        self.drop = drop_layers(model, self.keep)
        view = self.drop.view
        self.map = BlockMap(view, start.group)
        self.seqs: dict[int, _Seq] = {}
        for a in start.adopted:  # reserved first: nothing else may take those blocks
            if a.owner == me:
                blocks = -(-a.kv_tokens // self.block_size)
                self.map.reserve(a.request_id, [view.local_of_old(b)
                                                for b in old[a.request_id][:blocks]])
        for s in start.seqs:
            gen = generators.get(s.request_id) if me == 0 else restored_generator(
                s.sampling, s.request_id, arena.device, s.generator_state)
            self.seqs[s.request_id] = _Seq(tokens=list(s.tokens), table=list(s.table),
                                           sampling=s.sampling, generator=gen)
            for i, g in enumerate(s.table):
                if me == 0:
                    self.map.pin(g, view.local_of_old(g))
                else:
                    self.map.assign(s.request_id, i, g)
        self.receiver = self._kv_receiver(transfers)
        self._hidden = model.config.hidden_size

    def _kv_receiver(self, transfers: Sequence[KvTransfer]) -> KvReceiver:
        """What takes this member's chunks of `transfers` (its start's exchange) off its
        channel, counted in its stats."""
        c, start = self.model.config, self.start
        return KvReceiver(start.ranks, self.me, transfers, start.chunk_blocks, start.epoch,
                          (2, self.block_size, c.num_kv_heads, c.head_dim),
                          self.model.arena.dtype, self.stats, link=self.plane)

    # ------------------------------------------------------------------ steps

    def run(self, msg: StageStep) -> MemberReply:
        step = msg.step
        if not self.model.last_stage:
            for t in msg.fed_back:
                seq = self.seqs.get(t.request_id)
                if seq is not None:
                    seq.tokens.append(t.token_id)
        self._book(step)
        for w in step.seqs:
            self._place(w.request_id)
        if isinstance(msg, GroupStep):
            micro = pieces(step.seqs, msg.micro)
        else:
            ordered = sorted(step.seqs, key=lambda w: w.num_tokens == 1)
            micro = split_microbatches(ordered, self.start.microbatches,
                                       [w.num_tokens for w in ordered])
        sampled, compute, waits, cpu = [], [], [], []
        for m, work in enumerate(micro):
            c, w, out, u = self._microbatch(step.step_id, m, work)
            compute.append(c)
            waits.append(w)
            cpu.append(u)
            sampled.extend(out)
        own_core = self.model.arena.device.type == "cpu" and torch.get_num_threads() == 1
        prefetched = prefetch_state(self)  # raises a member lost
        try:
            self.plane.queue.flush("activation")  # KV chunks keep going behind them
        except RuntimeError as exc:  # the sending thread failed: the next member went away
            raise GroupMemberLost(self.start.ranks[min(self.me + 1, len(self.start.ranks) - 1)],
                                  "activations were being sent", exc) from exc
        return MemberReply(step_id=step.step_id, sampled=tuple(sampled),
                           compute_s=tuple(compute), wait_s=tuple(waits),
                           cpu_s=tuple(cpu) if own_core else (),
                           arrived=tuple(self.receiver.take_arrived()), prefetched=prefetched)

    def _activations(self, x: torch.Tensor, src: int, tag: int) -> None:
        """Receive them while watching the other members (`WatchedRecv`)."""
        w = self.__dict__.get("_watched")
        if w is None or w.link is not self.plane:  # (a grown group has a channel of its own)
            self._watched = w = WatchedRecv(self.plane)
        w.recv(x, src, tag, "activations were due")

    def end_exchange(self) -> None:
        """The group has restored: every queued tensor sent; its channel is closed."""
        self.plane.queue.flush()
        self.plane.close()

    def _book(self, step: ExecuteStep) -> None:
        self.map.move(step.moves)  # the head's pool shrank while grouped: ids move, KV stays
        for rid in step.release:
            self.seqs.pop(rid, None)
            self.map.done_reserving(rid)  # (one adopted that ended before its first step)
        for s in step.setups:
            gen = self._owned_gens.pop(s.request_id, None) or make_generator(
                s.sampling, fallback_seed=s.request_id, device=self.model.arena.device)
            self.seqs[s.request_id] = _Seq(tokens=list(s.prompt_ids), table=[],
                                           sampling=s.sampling, generator=gen)
        for u in step.blocks:
            seq = self.seqs[u.request_id]
            if u.reset:
                seq.table.clear()
            for g in u.append:
                copy = self.map.assign(u.request_id, len(seq.table), g, self._in_use)
                if copy is not None:
                    self._copy_block(*copy)
                seq.table.append(g)
            self.map.done_reserving(u.request_id)

    def _in_use(self, group_id: int) -> bool:
        """Whether a live request's table holds `group_id` (asked only when the head's
        allocator hands an adopted request an id this member has seen before)."""
        return any(group_id in s.table for s in self.seqs.values())

    def _copy_block(self, src: int, dst: int) -> None:
        for k_cache, v_cache in self.model._kv:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _place(self, request_id: int) -> None:
        """Wait for this request's own chunks (if any are due here) and write them into its
        blocks."""
        if not self.receiver.expects(request_id):
            return
        for t, data in self.receiver.wait(request_id):  # data [blocks, layers, 2, bs, H, D]
            locals_ = torch.tensor(self.map.locals(self.seqs[request_id].table[:t.blocks]))
            self.write_layers(locals_, t.layers, data)

    def write_layers(self, locals_: torch.Tensor, layers: range, data: torch.Tensor) -> None:
        device = self.model.arena.device
        for j, layer in enumerate(layers):
            k_cache, v_cache = self.model._kv[layer - self.keep.start]
            k_cache[locals_] = data[:, j, 0].to(device)
            v_cache[locals_] = data[:, j, 1].to(device)

    def read_layers(self, table: Sequence[int]) -> torch.Tensor:
        """This member's layers of blocks `table`: [blocks, kept layers, 2, bs, H, D] on host."""
        idx = torch.tensor(self.map.locals(table), dtype=torch.long)
        return torch.stack([torch.stack((k[idx], v[idx]), dim=1) for k, v in self.model._kv],
                           dim=1).to("cpu")

    @torch.inference_mode()
    def _microbatch(self, step_id: int, m: int,
                    work: Sequence[SeqWork]) -> tuple[float, float, list[SampledToken], float]:
        chunks = []
        for w in work:
            seq = self.seqs[w.request_id]
            chunks.append((seq.tokens[w.start:w.start + w.num_tokens], w.start,
                           self.map.locals(seq.table)))
        device = self.model.arena.device
        inputs = build_step_inputs(chunks, self.block_size, device,
                                   sample=[w.sample for w in work])
        waited, x = 0.0, inputs.input_ids
        ranks, tag = self.start.ranks, activation_tag(step_id, m)
        if not self.model.first_stage:
            began = time.perf_counter()
            x = torch.empty(len(inputs.input_ids), self._hidden, dtype=self.model.arena.dtype,
                            device=device)  # [T, hidden]
            self._activations(x, ranks[self.me - 1], tag)
            waited = time.perf_counter() - began
        began, cpu = time.perf_counter(), time.thread_time()
        out = self.model.forward_stage(x, inputs.positions, inputs.meta, inputs.logits_indices)
        sampled: list[SampledToken] = []
        if self.model.last_stage:
            sampled = sample_work(out, work, self.seqs)
        else:
            self.plane.queue.put_activation(out, dst=ranks[self.me + 1], tag=tag)
        return time.perf_counter() - began, waited, sampled, time.thread_time() - cpu
