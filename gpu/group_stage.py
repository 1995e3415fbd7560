"""One member's part of a pipeline group formed at run time (KunServe §4.1-4.2): its model with
the other members' layers dropped (gpu/stage_view.py), its block map, the group's sequences,
and the KV exchange in both directions. Every member runs this class; the head's runner
(gpu/group_runner.py) drives it and sends the others their control messages.

Forming the group: every member gathers the KV it must send (its own requests' KV for the other
members' layers: from the old full-layout blocks, before anything overwrites them), drops its
layers, maps the blocks that already hold its layers of a request's KV, and starts receiving.
A request whose KV is still arriving is placed into its blocks the first time a step includes
it, after waiting for exactly its own chunks.

The messages the head and members exchange, and the transfers a start implies, are in
gpu/group_messages.py. A restore prefetched while the group serves (gpu/restore_prefetch.py,
gpu/restore_kv.py) keeps its state on the stage (`prefetch`, `kv_prefetch`,
`prefetch_failed`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from engine.cluster.plan import split_microbatches
from engine.cluster.stage_fits import pieces
from engine.messages import ExecuteStep, SampledToken, SeqWork
from engine.params import SamplingParams
from gpu.block_map import BlockMap
from gpu.data_plane import Channel, DataPlane, GroupMemberLost, open_channel
from gpu.group_gens import hand_generators
from gpu.group_messages import (
    GroupStart,
    GroupStep,
    MemberReply,
    restored_generator,
    start_transfers,
)
from gpu.kv_exchange import ExchangeStats, KvReceiver, KvTransfer, WatchedRecv, send_transfers
from gpu.metadata import build_step_inputs
from gpu.pipeline_stage import StageStep, sample_work
from gpu.pipeline_stage import _tag as activation_tag
from gpu.restore_kv import send_kv_round
from gpu.restore_prefetch import prefetch_state
from gpu.sampler import make_generator
from gpu.stage_view import drop_layers, send_gained

if TYPE_CHECKING:
    from gpu.restore_kv import KvPrefetch
    from gpu.restore_prefetch import WeightPrefetch

STEP_FAULT_ENV = "SHUNTER_GROUP_STEP_FAULT"
"""Tests' fault: `kv-round@<rank>` makes that member's first step that carries a restore
prefetch's KV round fail (an error, not a loss) once it ran, before the round is sent;
`step@<rank>` (the head's too) makes that member's first such step fail before its first
microbatch, once it took the step's bookings."""


@attrs.define(slots=True, eq=False)
class _Seq:
    tokens: list[int]
    table: list[int]
    sampling: SamplingParams
    generator: torch.Generator | None


class GroupStage:
    prefetch: WeightPrefetch | None = None
    """This member's dropped weights being written back while the group serves (gpu/
    restore_prefetch.py), once the head started the restore's prefetch."""
    kv_prefetch: KvPrefetch | None = None
    """The head's: the full blocks' KV coming back from the members before the restore's step
    (gpu/restore_kv.py)."""
    prefetch_failed: BaseException | None = None
    """A member's: why its prefetch could not start (its next step's reply raises it)."""
    kv_void: str | None = None
    """A member's: why its restore prefetch's first KV round could not be gathered; that
    round and every later one go as zeros (gpu/group_member.py `start_prefetch`)."""
    kv_seq: int = 0
    """A member's next chunk number of its restore prefetch's KV rounds (gpu/restore_kv.py)."""
    host_bytes: int = 0
    """KV bytes of its own layers it read to host memory (`read_layers`: to send them, or to
    stage them); the head's restore reads none (gpu/restore_kv.py)."""

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
        """Run one step; a member then sends the KV round the head named with it (`kv_spans`:
        the head posted its receives): if the step failed here (an error, not a loss), zeros
        in its place, so the chunks' numbers stay the head's (the head voids that round)."""
        spans = {rid: (lo, hi) for rid, lo, hi in getattr(msg, "kv_spans", ())} if self.me else {}
        try:
            reply = self._run(msg)
            if spans and os.environ.get(STEP_FAULT_ENV) == f"kv-round@{self.plane.rank}":
                del os.environ[STEP_FAULT_ENV]  # (once)
                raise RuntimeError("the test's fault: this step failed before its KV round")
            self._kv_round(spans, placeholder=self.kv_void is not None)
        except GroupMemberLost:
            raise
        except Exception:
            self._level_activations(msg)  # the next member's step must end too
            self._kv_round(spans, placeholder=True)  # (the real one sends all or nothing)
            raise  # (the requests whose KV arrived stay in its receiver: `failed_reply`)
        return attrs.evolve(reply, arrived=tuple(self.receiver.take_arrived()))

    def failed_reply(self, step_id: int, exc: Exception) -> MemberReply:
        """A member's answer to a step that failed here (not a loss): the error, and the
        requests whose KV arrived since its last answer (taken now: were they lost with the
        failed step, the head would never hear of them and they would wait for ever); and, as
        every answer, the state of its restore prefetch (weights in, a fallback to the
        restore's step), so the head need not wait for a step that succeeds to hear it. A
        prefetch that ended in a loss is answered as one."""
        arrived, error = tuple(self.receiver.take_arrived()), f"{type(exc).__name__}: {exc}"
        try:
            prefetched = prefetch_state(self)
        except GroupMemberLost as lost:
            return MemberReply(step_id=step_id, error=str(lost), lost=lost.rank, arrived=arrived)
        except Exception:  # noqa: BLE001 (the next step's answer raises it: not a loss)
            prefetched = None
        return MemberReply(step_id=step_id, error=error, arrived=arrived, prefetched=prefetched,
                           kv_void=self.kv_void,
                           weights_from_host=getattr(self.prefetch, "from_host", None))

    def _level_activations(self, msg: StageStep) -> None:
        """The step failed here (not a loss): take the activations still due from the previous
        member and send zeros for those still due to the next, so that every member's step ends
        and the next step's tags start level (the failed step's requests are failed)."""
        done_in, done_out = self._micro_io
        if not isinstance(msg, GroupStep) or (self.model.first_stage and self.model.last_stage):
            return
        ranks, device = self.start.ranks, self.model.arena.device
        for m, work in enumerate(pieces(msg.step.seqs, msg.micro)):
            shape = (sum(w.num_tokens for w in work), self._hidden)
            x = torch.zeros(shape, dtype=self.model.arena.dtype, device=device)
            if not self.model.first_stage and m >= done_in:
                self._activations(x, ranks[self.me - 1], activation_tag(msg.step.step_id, m))
            if not self.model.last_stage and m >= done_out:
                self._to_next(lambda x=x, m=m: self.plane.queue.put_activation(
                    x.zero_(), dst=ranks[self.me + 1], tag=activation_tag(msg.step.step_id, m)))
        self._to_next(lambda: self.plane.queue.flush("activation"))

    def _to_next(self, send) -> None:
        """`send()` (activations queued or flushed): a failed sending thread means the next
        member went away, its loss (`GroupMemberLost` naming it: the head recovers at once,
        reading no answer a live member would not give)."""
        try:
            send()
        except GroupMemberLost:
            raise
        except RuntimeError as exc:
            raise GroupMemberLost(self.start.ranks[min(self.me + 1, len(self.start.ranks) - 1)],
                                  "activations were being sent", exc) from exc

    def _kv_round(self, spans: Mapping[int, tuple[int, int]], placeholder: bool) -> None:
        if spans:
            send_kv_round(self, self.start.ranks, self.me, self.start.layers, spans,
                          self.start.chunk_blocks, placeholder)

    def _run(self, msg: StageStep) -> MemberReply:
        step = msg.step
        self._micro_io = [0, 0]  # microbatches whose activations came in, went out
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
        if (getattr(msg, "kv_spans", ())
                and os.environ.get(STEP_FAULT_ENV) == f"step@{self.plane.rank}"):
            del os.environ[STEP_FAULT_ENV]  # (once)
            raise RuntimeError("the test's fault: this step failed before its microbatches")
        sampled, compute, waits, cpu = [], [], [], []
        for m, work in enumerate(micro):
            c, w, out, u = self._microbatch(step.step_id, m, work)
            compute.append(c)
            waits.append(w)
            cpu.append(u)
            sampled.extend(out)
        own_core = self.model.arena.device.type == "cpu" and torch.get_num_threads() == 1
        prefetched = prefetch_state(self)  # raises a member lost
        self._to_next(lambda: self.plane.queue.flush("activation"))  # (KV chunks behind them)
        return MemberReply(step_id=step.step_id, sampled=tuple(sampled),
                           compute_s=tuple(compute), wait_s=tuple(waits),
                           cpu_s=tuple(cpu) if own_core else (),
                           prefetched=prefetched,
                           kv_void=self.kv_void, weights_from_host=getattr(
                               self.prefetch, "from_host", None))

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
        out = self.gather_layers(self.map.locals(table)).to("cpu")
        self.host_bytes += out.numel() * out.element_size()
        return out

    def gather_layers(self, locals_: Sequence[int]) -> torch.Tensor:
        """This member's layers of stage blocks `locals_`, copied on its device: [blocks, kept
        layers, 2, bs, H, D]."""
        idx = torch.tensor(locals_, dtype=torch.long, device=self.model.arena.device)
        return torch.stack([torch.stack((k[idx], v[idx]), dim=1) for k, v in self.model._kv],
                           dim=1)

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
            self._micro_io[0] += 1
            waited = time.perf_counter() - began
        began, cpu = time.perf_counter(), time.thread_time()
        out = self.model.forward_stage(x, inputs.positions, inputs.meta, inputs.logits_indices)
        sampled: list[SampledToken] = []
        if self.model.last_stage:
            sampled = sample_work(out, work, self.seqs)
        else:
            self.plane.queue.put_activation(out, dst=ranks[self.me + 1], tag=tag)
            self._micro_io[1] += 1
        return time.perf_counter() - began, waited, sampled, time.thread_time() - cpu
