"""The head's step runner while its instance leads a pipeline group of running instances
(KunServe §4.1-4.4), and the loop a member instance serves the group with.

`GroupRunner` wraps the head's own `TorchRunner` (its model, arena, device thread and
sequences). `open()` tells every member to join (`GroupStart` over the data plane, then
`GroupGo` once every member got its start), drops the head's own other layers and starts the KV
exchange; each `execute(step)` sends the step to every member, runs the head's layers (the first
stage) and collects the members' answers, the last one's sampled tokens included;
`restore(tables)` brings every member's dropped layers back (from the members keeping them, or
from each one's host copy; with `prefetch_restore` first, written in place while the group
served: gpu/restore_prefetch.py), moves the KV of the head's requests for the layers it had
dropped back to the head, and leaves everyone serving alone (the KV moved: gpu/kv_moved.py). A
member serves with `serve_member(runner, head_rank)` (gpu/group_member.py) until then.

Faults: any send or receive with a lost member raises `GroupMemberLost` naming it; the head then
`recover_from_host()`s: its dropped layers come back from its host copy, and every request loses
the KV of the lost member's layers, so the engine recomputes them (their tables are empty on the
runner). A loss found at the restore's step once the weights are back leaves the model whole:
only the KV is lost.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence

from engine.cluster.plan import PipelineTotals, pipeline_timing
from engine.cluster.stage_fits import StageFits, check_cut
from engine.messages import ExecuteStep, SampledToken, StepFinished
from gpu.data_plane import (
    CONTROL_TAG,
    REPLY_TAG,
    GroupMemberLost,
    data_plane,
    new_channel_key,
    recv_obj,
    send_obj,
)
from gpu.group_messages import (
    Adopted,
    GroupAbandon,
    GroupGo,
    GroupStart,
    GroupStep,
    MemberReply,
    SeqState,
    generator_state,
    start_transfers,
)
from gpu.group_stage import GroupStage
from gpu.kv_exchange import known_lost, lost_error
from gpu.kv_moved import count_moved, transfer_bytes
from gpu.pipeline import StepRecord
from gpu.restore_group import restore_group
from gpu.restore_kv import KvPrefetch, full_blocks, note_step
from gpu.restore_prefetch import (GroupPrefetch, PrefetchBroken, WeightPrefetch, room_outside,
                                  stop_prefetch)
from gpu.stage_view import group_pool_blocks, restore_layers

MIN_CHUNK_TOKENS = 4
"""Lookahead never cuts a prefill into a piece under this many tokens (§4.3 Figure 11, lines
4-5: formation stops below a threshold). The simulator uses 32 for the 8B profile's GEMMs; the
tiny CPU models and short prompts the torch groups run in tests are cut down to a block."""


class GroupRunner:
    def __init__(self, solo, ranks: Sequence[int], layers: Sequence[range],
                 adopted: Sequence[Adopted] = (), *, chunk_blocks: int = 4,
                 microbatches: int | None = None, microbatch: str = "tokens",
                 fits: StageFits | None = None, kv_exchange: str = "coordinated") -> None:
        """`microbatch`: how each step is cut (`tokens` or `lookahead`, the policy's setting);
        `fits`: the stages' Eq. 1-3 fits to go on from (a previous group of the same split);
        `kv_exchange`: `coordinated` (KV chunks behind activations) or `fifo` (one queue)."""
        check_plan(ranks, layers, solo._model.config.num_layers)
        if kv_exchange not in ("coordinated", "fifo"):
            raise ValueError(f"kv_exchange must be 'coordinated' or 'fifo', got {kv_exchange!r}")
        self.kv_exchange, self.solo, self.microbatch = kv_exchange, solo, microbatch
        self.fits = fits if fits is not None else StageFits(len(ranks))
        self.totals = PipelineTotals()
        """The steps' GPipe schedule replayed with each stage's measured microbatch times
        (engine/cluster/plan.py `pipeline_timing`; activations' transfer not counted)."""
        self.cpu_clock = False  # the stages' times: their threads' CPU times (group_stage `cpu_s`)
        self.last_cut: tuple = ()
        """The last step's microbatches (engine/cluster/stage_fits.py `Cut`)."""
        self.last_stage_s: list = []
        """The last step's stage times per microbatch (seconds, the clock `cpu_clock` says)."""
        self.wall = [0.0, 0.0]  # [stage compute s, stages x step wall s] as they ran here
        self.ranks, self.layers, self.adopted = tuple(ranks), tuple(layers), tuple(adopted)
        self.chunk_blocks, self.microbatches = chunk_blocks, microbatches or 2 * len(self.ranks)
        self.last_step = time.monotonic()  # when a step was last sent (the head's keepalive)
        arena = solo._model.arena
        self.pool = range(arena.weight_blocks, arena.weight_blocks + group_pool_blocks(
            solo._model.config, arena.block_size, arena.dtype, arena.total_blocks, self.layers))
        """The group's block ids (they include the head's solo ids)."""
        self.stage: GroupStage | None = None
        self._fed_back: tuple[SampledToken, ...] = ()
        self._unanswered: list[int] = []  # sent the current step, answer not read yet
        self._expect: dict[int, set[int]] = {}  # request -> members its KV still goes to
        self._ready: list[int] = []  # arrived on every member, not yet taken by `arrived()`
        self.records: list[StepRecord] | None = None
        self.exchange = None  # the head's exchange counters (set at `open`)
        self.restore_stats: dict[str, object] = {}
        self._prefetched: set[int] = set()  # members whose prefetched weights are in
        self.prefetch_heard: set[int] = set()
        """Members that answered a step since the restore's prefetch began."""
        self.prefetch_fallbacks: dict[str, str] = {}
        """'<rank> kv' / '<rank> weights' -> why that part of its prefetch falls back to the
        restore's step (gpu/group_member.py `start_prefetch`)."""
        self._computed: dict[int, int] = {}  # request -> tokens whose KV is written
        self.set_up: set[int] = set()
        """Requests some step of this group set up (an adopted one not among them still has its
        KV staged or reserved: gpu/group_grow.py waits for it)."""

    # ------------------------------------------------------------------ forming

    def open(self) -> range:
        plane = data_plane()
        if self.ranks[0] != plane.rank:
            raise ValueError(f"the head must be member 0: ranks {self.ranks}, this is "
                             f"{plane.rank}")
        seqs = tuple(SeqState(request_id=rid, tokens=tuple(s.tokens), table=tuple(s.table),
                              sampling=s.sampling, generator_state=generator_state(s.generator))
                     for rid, s in self.solo._seqs.items())
        start = GroupStart(ranks=self.ranks, layers=self.layers, group=self.pool, seqs=seqs,
                           adopted=self.adopted, chunk_blocks=self.chunk_blocks,
                           microbatches=self.microbatches, kv_exchange=self.kv_exchange,
                           channel=new_channel_key(plane))
        for msg in (start, GroupGo()):  # a member starts only once every member got its start
            for rank in self.ranks[1:]:
                try:
                    send_obj(msg, rank, CONTROL_TAG, "the group was being formed")
                except GroupMemberLost as exc:  # the others are told; nothing dropped here
                    abandon_members(self.ranks[1:], lost=rank, why=str(exc))
                    raise
        gens = {rid: s.generator for rid, s in self.solo._seqs.items()}
        try:
            self.stage = GroupStage(self.solo._model, plane, start, 0, {}, gens)
        except Exception as exc:  # re-raised; the head's own requests keep their KV
            abandon_members(self.ranks[1:], lost=-1, why=f"the head could not join: {exc}")
            if getattr(self.solo._model, "drop_state", None) is not None:
                restore_layers(self.solo._model)
            raise
        self.exchange = self.stage.stats  # (bytes, chunks, per-request arrival times)
        self.solo._seqs.clear()
        for t in (transfers := start_transfers(start, self.stage.block_size)):
            self._expect.setdefault(t.request_id, set()).add(t.dst)
        self._ready = [a.request_id for a in self.adopted if a.request_id not in self._expect]
        count_moved(self.solo, transfer_bytes(transfers, self.stage.model, self.stage.block_size))
        self._note_arrived(0, self.stage.receiver.take_arrived())
        return self.pool

    def _note_arrived(self, member: int, rids: Sequence[int]) -> None:
        for rid in rids:
            left = self._expect.get(rid)
            if left is not None:
                left.discard(member)
                if not left:
                    del self._expect[rid]
                    self._ready.append(rid)

    def arrived(self) -> list[int]:
        """Requests whose KV is complete on every member since the last call."""
        self._note_arrived(0, self.stage.receiver.take_arrived())
        out, self._ready = self._ready, []
        return out

    def exchanging(self) -> set[int]:
        """Requests whose KV is still arriving somewhere."""
        return set(self._expect)

    # ------------------------------------------------------------------ steps

    def execute(self, step: ExecuteStep) -> StepFinished:
        began = time.perf_counter()
        self.set_up.update(s.request_id for s in step.setups)
        cut = self.fits.cut(step.seqs, self.microbatches, self.microbatch,
                            min_tokens=MIN_CHUNK_TOKENS) if step.seqs else ()
        check_cut(step.seqs, cut)  # (before a round is named: no member would send it)
        self.last_cut = cut
        spans = note_step(self._computed, self.stage, step)  # (a restore prefetch's next round)
        msg = GroupStep(step=step, fed_back=self._fed_back, micro=cut, kv_spans=spans)
        self.last_step = time.monotonic()
        if gone := known_lost(self.ranks[1:]):
            raise lost_error(gone[0], f"step {step.step_id} was sent")
        self._unanswered = []
        try:
            return self._run(step, msg, began)
        except GroupMemberLost:
            raise
        except Exception:  # the step failed (not a loss): its KV round is not used
            if spans:  # (every member sent it, as placeholders where it failed)
                self.stage.kv_prefetch.void({rid: (lo, hi) for rid, lo, hi in spans})
            raise

    def _run(self, step: ExecuteStep, msg: GroupStep, began: float) -> StepFinished:
        for rank in self.ranks[1:]:
            send_obj(msg, rank, CONTROL_TAG, f"step {step.step_id} was sent")
            self._unanswered.append(rank)
        try:
            mine = self.stage.run(msg)
        except GroupMemberLost:
            raise
        except Exception:  # (not a loss: it sent the members zeros for its activations)
            self._answers(step)  # every member's answer read: the next step starts level
            raise
        finally:
            self._fed_back = ()  # run() appended them to the head's sequences
        replies = [mine]
        self._note_arrived(0, mine.arrived)  # (taken from its receiver: noted whatever follows)
        for rank, reply in self._answers(step):
            if reply.error is not None:
                raise RuntimeError(f"pipeline group member instance {rank}: {reply.error}")
            replies.append(reply)
        self._fed_back = replies[-1].sampled
        missing = ({w.request_id for w in step.seqs if w.sample}
                   - {t.request_id for t in self._fed_back})
        if missing:
            raise RuntimeError(f"pipeline group step {step.step_id} sampled no token for "
                               f"requests {sorted(missing)} (its microbatches left them out)")
        if msg.micro:
            self._account(msg.micro, replies, time.perf_counter() - began)
        if self.records is not None:
            self.records.append(StepRecord(
                step_id=step.step_id, wall_s=time.perf_counter() - began,
                compute_s=tuple(r.compute_s for r in replies),
                wait_s=tuple(r.wait_s for r in replies)))
        return StepFinished(step_id=step.step_id, sampled=self._fed_back,
                            compute_s=time.perf_counter() - began)

    def _answers(self, step: ExecuteStep) -> list[tuple[int, MemberReply]]:
        """Every member's answer to `step`, all read before any is judged (one left unread would
        answer the next step); a loss one reports raises `GroupMemberLost`."""
        out = []
        for m, rank in enumerate(self.ranks[1:], start=1):
            out.append((rank, recv_obj(rank, REPLY_TAG, f"step {step.step_id} ran")))
            self._unanswered.remove(rank)
            self._note_arrived(m, out[-1][1].arrived)  # (a failed step's too: taken there)
            self._note_prefetch(rank, out[-1][1])  # (so are its prefetch's flags)
        for rank, reply in out:
            if reply.lost == -1:  # (none gone: a member's prefetch broke part-way)
                raise PrefetchBroken(f"instance {rank}: {reply.error}")
            if reply.lost is not None:
                raise GroupMemberLost(reply.lost, f"step {step.step_id} ran (reported by "
                                      f"instance {rank})", RuntimeError(reply.error))
        return out

    def _note_prefetch(self, rank: int, reply: MemberReply) -> None:
        """A member's answer on the restore's prefetch (since it began: what it says of its
        start is in): weights in; a fallback to the restore's step (its KV rounds are zeros:
        none is used; its weights from its host copy there)."""
        kv = self.stage.kv_prefetch
        if kv is None:
            return
        self.prefetch_heard.add(rank)
        if reply.prefetched:
            self._prefetched.add(rank)
        if reply.kv_void is not None:
            kv.abandon(f"instance {rank}: {reply.kv_void}")
        for what, why in (("kv", reply.kv_void), ("weights", reply.weights_from_host)):
            if why is not None:
                self.prefetch_fallbacks.setdefault(f"{rank} {what}", why)

    def _account(self, cut, replies: Sequence[MemberReply], wall: float) -> None:
        """Each stage's time per microbatch (its thread's CPU time where it reports one, else
        wall time) feeds the fits and the replayed schedule; wall time the wall ratio."""
        compute_s = [r.compute_s for r in replies]
        stage_s = [r.cpu_s or r.compute_s for r in replies]
        if any(len(c) != len(cut) for c in stage_s):
            raise RuntimeError(f"the members ran {[len(c) for c in stage_s]} microbatches of "
                               f"a cut of {len(cut)}")
        self.fits.observe(cut, [[x * 1e3 for x in c] for c in stage_s])
        self.totals.add(pipeline_timing(stage_s, [0.0] * len(cut)), len(cut))
        self.cpu_clock = all(r.cpu_s for r in replies)
        self.last_stage_s = stage_s
        self.wall[0] += sum(map(sum, compute_s))
        self.wall[1] += len(compute_s) * wall

    def pipeline_report(self) -> dict:
        """Bubble ratios and the cost model's prediction error over the group's steps."""
        t = self.totals
        return {"microbatch": self.microbatch, "stage_clock": "thread cpu" if self.cpu_clock
                else "wall", "steps": t.steps, "microbatches": t.microbatches,
                "bubble_ratio": t.bubble_ratio, "busy_s": t.busy_s, "makespan_s": t.makespan_s,
                "wall_bubble_ratio": 1 - self.wall[0] / self.wall[1] if self.wall[1] else 0.0,
                "cost_model": self.fits.report()}

    def poll(self, step_id: int) -> list[int]:
        """An empty step (members report arrivals); returns `arrived()`."""
        self.execute(ExecuteStep(step_id=step_id, release=(), setups=(), blocks=(), seqs=()))
        return self.arrived()

    # ------------------------------------------------------------------ restore

    def restore(self, tables: Mapping[int, Sequence[int]], source: str = "peer",
                release: Sequence[int] = ()) -> None:
        """Solo again. `tables`: every live request's solo block ids (below the solo range's
        end); `release`: requests ended since the last step. Afterwards the head's TorchRunner
        holds every request, with these tables (gpu/restore_kv.py)."""
        restore_group(self, tables, source, release)

    def prefetch_restore(self, source: str, pool: range) -> None:
        """Start writing every member's dropped layers back while the group serves (gpu/
        restore_prefetch.py); `pool`: the group ids the engine's pool holds now (shrunk back:
        the rest of the dropped memory is vacated). `restore` later waits for what is left."""
        if self.stage.prefetch is not None:
            raise RuntimeError("the restore is being prefetched already")
        if len(pool) > (room := room_outside(self.stage.model, self.layers)):
            raise ValueError(f"a restore prefetch needs the pool shrunk to at most {room} "
                             f"blocks first (the dropped layers' memory is vacated); it has "
                             f"{len(pool)}")
        blocks = full_blocks(self.stage, self._computed)
        msg = GroupPrefetch(source=source, pool=pool, kv_blocks=blocks)
        self._prefetched, self.prefetch_heard = set(), set()  # (the head's own first: what
        self.prefetch_fallbacks = {}  # refuses it refuses it here)
        self.stage.prefetch = WeightPrefetch(self.stage, self.ranks, self.layers, msg)
        self.stage.kv_prefetch = KvPrefetch(self.stage, self.ranks, self.layers,
                                            self.chunk_blocks, blocks)
        for rank in self.ranks[1:]:
            send_obj(msg, rank, CONTROL_TAG, "the restore was prefetched")

    def restore_ready(self) -> bool | None:
        """Whether every member's prefetched weights are in (per the last step's answers);
        None: no prefetch runs. Raises the loss of a member the head's prefetch saw."""
        prefetch = self.stage.prefetch
        if prefetch is None:
            return None
        return (prefetch.check() and len(self._prefetched) == len(self.ranks) - 1
                and not self.stage.kv_prefetch.pending())

    def recover_from_host(self, lost: int, why: str | None = None) -> list[int]:
        """After member instance `lost` was lost (-1: none, the group given up for `why`): every
        survivor is told to restore from its host copy (`GroupAbandon`); the head's dropped
        layers come back from its own, and every request keeps its tokens but no KV (an empty
        table): the engine must recompute them. Returns their ids."""
        stage = self.stage
        for rank in self._unanswered:  # sent the step: read its answer (its waits watch the
            with contextlib.suppress(GroupMemberLost):  # plane; unread, that answer and our
                recv_obj(rank, REPLY_TAG, "the step was answered")  # GroupAbandon deadlock)
        self._unanswered = []
        abandon_members(self.ranks[1:], lost=lost, why=why or f"member instance {lost} lost")
        for t in self._fed_back:
            if t.request_id in stage.seqs:
                stage.seqs[t.request_id].tokens.append(t.token_id)
        stage.plane.close(broken=True)  # nothing left on the group's channel matches anything
        stop_prefetch(stage)  # (its receives ended with the channel) before the host copy
        if stage.model.drop_state is not None:  # (lost at the restore once its weights were
            restore_layers(stage.model)  # back: the model is whole, only the KV is lost)
        for rid, s in stage.seqs.items():
            self.solo._seqs[rid] = _solo_seq(self.solo, s, [])
        self.stage = None
        return sorted(self.solo._seqs)

    # ------------------------------------------------------------------ executor protocol

    async def start(self) -> range:
        return await self.solo._thread.run(self.open)

    async def step(self, step: ExecuteStep) -> StepFinished:
        return await self.solo._thread.run(self.execute, step)


def check_plan(ranks: Sequence[int], layers: Sequence[range], num_layers: int) -> None:
    """A group's plan must give each of its distinct members a contiguous layer range, in
    order, covering the model's layers exactly once."""
    covered = 0
    for r in layers:
        if r.step != 1 or r.start != covered or r.stop <= r.start:
            break
        covered = r.stop
    else:
        if covered == num_layers and len(layers) == len(ranks) == len(set(ranks)) >= 2:
            return
    raise ValueError(f"pipeline group plan: members {tuple(ranks)} with layers "
                     f"{[(r.start, r.stop) for r in layers]} do not split the model's "
                     f"{num_layers} layers into one contiguous range per member")


def abandon_members(ranks: Sequence[int], *, lost: int, why: str) -> None:
    """Tell every member in `ranks` but `lost` that the group is over (`GroupAbandon`; a member
    that had not started yet serves alone at once). Members that cannot be reached, or known
    gone (`known_lost`), are skipped."""
    gone = known_lost(ranks)
    for rank in ranks:
        if rank != lost and rank not in gone:
            try:
                send_obj(GroupAbandon(lost=lost, why=why), rank, CONTROL_TAG,
                         "the group was abandoned")
            except GroupMemberLost:
                pass  # lost as well: nothing to tell it


def _solo_seq(solo, s, table: list[int]):
    from gpu.runner import _DeviceSeq

    return _DeviceSeq(tokens=s.tokens, table=table, sampling=s.sampling, generator=s.generator)
