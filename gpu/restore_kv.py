"""The head's side of a pipeline group's restore (KunServe §4.4) and the KV it moves: every live
request's KV of the members' layers comes to the head and is written into the solo tables its
engine chose. The head's own kept layers of a block already lie in that block's solo place when
its stage block's base is the solo block's (a block the head held before the group formed and
whose id did not move: gpu/stage_view.py `StageView.base`); every other block's are copied on
the device (gathered before the weights come back over the dropped memory, then written into the
solo blocks): none goes through host memory (`own_kv_host_bytes`). With a restore prefetch the head
put its blocks there as it vacated (gpu/block_map.py `place`), so only one whose place was held
(by a reservation) is gathered (`own_kv_device_bytes`: 0 in the tests).

With a restore prefetch (gpu/restore_prefetch.py) the KV of every *full* block moves before the
restore's step too: a block whose tokens are all computed never changes again while its request
lives and keeps its table (decoding writes only the last block). It moves in rounds, each on the
KV lane behind activations (tag epoch `KV_EPOCH`, the chunks' sequence numbers going on from one
round to the next): the first as the prefetch starts (`GroupPrefetch.kv_blocks`: every live
request's leading full blocks, from the tokens the head's steps computed), then one with every
pipelined step that fills blocks (`GroupStep.kv_spans`: the blocks that step fills, named by the
head as it sends it; each member gathers its layers of them once it ran the step). The head
posts a round's receives before it tells the members, and its own kept layers of them stay on
its device. A request whose table is reset since (preempted, recomputed) starts again from its
first block (what was taken of it before is not used: `KvPrefetch.generation`); one that ended
is forgotten; their chunks still arrive and are dropped. The restore's step then moves only the
blocks after those (`GroupRestore.skip`: a live request's last, partly filled block) and writes
the prefetched ones as received.

What the rounds hold until then does not grow with the steps the prefetch spans. Host memory:
each round's staging (allocated as it is named, written into the arena at the restore's step)
is at most the members' layers of every live request's full blocks, the bytes a one-step
restore receives at its step anyway (`kv_staged_bytes` at the restore equals it in the tests):
a request released or reset lets what its earlier rounds took go (chunks still due land in a
tensor let go at once: `KvReceiver.drop`), and a round left with nothing is let go. It is not
written into the arena as it arrives: until the restore's step the members' layers of a solo
block lie where the head's stage view keeps other blocks' KV and the dropped weights come back.
Threads: one per member for the whole prefetch (`RecvWorker`: each round's receive loop from
that member runs there after the one before, the order the member queues them in); before,
every round started its own, and rounds queued behind the weights' chunks (every step while
they stream) each held one blocked. Exchanged KV no step placed yet (a request not run since the
group formed) is written into its blocks before the restore reads them, here and on the members.
Faults: a member whose step failed (an error, not a loss) still sends that step's round, zeros in
its place, and the head voids it (`KvPrefetch.void`): the chunks' numbers stay the same on both
ends. A member whose first round could not be gathered sends it and every later one as zeros
and says so in its answers (`MemberReply.kv_void`): the head then names no more rounds and uses
none (`KvPrefetch.abandon`; every block's KV moves at the restore's step). The restore (gpu/
restore_group.py) waits for rounds still due before it changes anything, watching for a lost
member, at most `KV_JOIN_S` (then a plain error: the group serves on).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import attrs
import torch

from engine.messages import ExecuteStep
from gpu.kv_exchange import (WATCH_SLICE_S, KvReceiver, KvTransfer, RecvWorker, known_lost,
                             lost_error, pair_chunks, send_transfers)

KV_JOIN_S = 30.0
"""How long a restore waits for the prefetched KV rounds still due (under gloo's 60 s receive
timeout, which would name a live member lost): normally none is (`restore_ready`)."""

KV_EPOCH = 15
"""The prefetched KV's tag epoch on the group's channel (0 forming, 1 restoring, 2+ growing:
each growth on a channel of its own)."""


def restore_transfers(seqs: Mapping[int, object], layers: Sequence[range],
                      skip: Mapping[int, int] = {}) -> list[KvTransfer]:
    """Each member's layers of every live request's blocks after its first `skip[rid]` (those
    moved before), back to the head; `blocks` counts from there."""
    return prefetch_transfers({rid: len(s.table) - min(skip.get(rid, 0), len(s.table))
                               for rid, s in seqs.items()}, layers)


def prefetch_transfers(blocks: Mapping[int, int], layers: Sequence[range]) -> list[KvTransfer]:
    """Each member's layers of each request's first `blocks[rid]` blocks, to the head."""
    return [KvTransfer(request_id=rid, src=k, dst=0, layers=layers[k], blocks=n)
            for rid, n in sorted(blocks.items()) for k in range(1, len(layers)) if n]


def round_chunks(blocks: Mapping[int, int], layers: Sequence[range], chunk_blocks: int) -> int:
    """Chunks a round of `blocks` (request -> blocks) takes from each member (the same number
    from every one: each sends its layers of the same blocks)."""
    return len(pair_chunks(prefetch_transfers(blocks, layers), 1, 0, chunk_blocks))


def note_step(computed: dict[int, int], stage, step: ExecuteStep) -> tuple:
    """The head's record of each request's computed tokens (whose KV every member wrote once
    `step` ran); with a restore prefetch running, the round of the blocks `step` fills, its
    receives posted: ((request, first block, stop block), ...) for `GroupStep.kv_spans`."""
    for u in step.blocks:
        if u.reset:
            computed.pop(u.request_id, None)
    for rid in step.release:
        computed.pop(rid, None)
    for w in step.seqs:
        computed[w.request_id] = w.start + w.num_tokens
    kv = stage.kv_prefetch
    if kv is None:
        return ()
    spans = kv.step_spans(step)
    if spans:
        kv.add(spans)
    return tuple((rid, lo, hi) for rid, (lo, hi) in sorted(spans.items()))


def block_shape(stage) -> tuple[int, ...]:
    c = stage.model.config
    return (2, stage.block_size, c.num_kv_heads, c.head_dim)


def full_blocks(stage, computed: Mapping[int, int]) -> dict[int, int]:
    """Each live request's leading blocks whose every token is computed (`computed`: tokens
    with KV written, `note_step`)."""
    bs = stage.block_size
    return {rid: n for rid, s in stage.seqs.items()
            if (n := min(computed.get(rid, 0) // bs, len(s.table)))}


@attrs.define(eq=False)
class _Round:
    spans: dict[int, tuple[int, int, int]]
    """Request -> (first block, stop block, its generation when named)."""
    receiver: KvReceiver


class KvPrefetch:
    """The head's prefetched KV of full blocks: the members' layers, arriving in rounds (its own
    stay on its device until the restore's step)."""

    def __init__(self, stage, ranks: Sequence[int], layers: Sequence[range], chunk_blocks: int,
                 blocks: Mapping[int, int]) -> None:
        """`blocks`: request -> its leading full blocks now (`full_blocks`): the first round."""
        self.stage, self.ranks, self.layers = stage, tuple(ranks), tuple(layers)
        self.chunk_blocks = chunk_blocks
        self.named: dict[int, int] = {}
        """Request -> its leading blocks taken so far (of its table now)."""
        self.generation: dict[int, int] = {}
        """Request -> how many times its table was reset since the prefetch began (what was
        taken of an older one is not used)."""
        self.rounds: list[_Round] = []
        """Rounds that still hold KV to write or chunks to come (`_forget` lets the others
        go)."""
        self.workers = {k: RecvWorker(f"shunter-kv-prefetch-{k}")
                        for k in range(1, len(self.layers))}
        """Source member -> the one thread that receives every round's chunks from it."""
        self.threads = len(self.workers)  # receiving threads started for its rounds
        self.later = [0, 0]  # rounds after the first, their blocks
        self.staged_peak = 0
        """The most host bytes the rounds' staging held at once (`KvReceiver.staged_bytes`)."""
        self.seq = 0
        """The next round's first chunk sequence number (on each member's pair with the head)."""
        self.abandoned: str | None = None
        """Why its rounds are not used (a member sends zeros: `abandon`); None: they are."""
        self.began_host = stage.host_bytes  # (the head's own KV read to host since: none)
        self.began_bytes = stage.stats.received_bytes
        self.add({rid: (0, n) for rid, n in blocks.items()})

    def add(self, spans: Mapping[int, tuple[int, int]]) -> None:
        """A round: every member's layers of blocks [first, stop) of each request in `spans`;
        its receives are posted here, before the members are told."""
        stage, counts = self.stage, {rid: hi - lo for rid, (lo, hi) in spans.items()}
        receiver = KvReceiver(self.ranks, 0, prefetch_transfers(counts, self.layers),
                              self.chunk_blocks, KV_EPOCH, block_shape(stage),
                              stage.model.arena.dtype, stage.stats, link=stage.plane,
                              seq_base=self.seq, workers=self.workers)
        self.seq += round_chunks(counts, self.layers, self.chunk_blocks)
        self.rounds.append(_Round({rid: (lo, hi, self.generation.get(rid, 0))
                                   for rid, (lo, hi) in spans.items()}, receiver))
        for rid, (_, hi) in spans.items():
            self.named[rid] = hi
        self.threads += receiver.own_threads
        if len(self.rounds) > 1:
            self.later[0] += 1
            self.later[1] += sum(counts.values())
        self.staged_peak = max(self.staged_peak, self.staged_bytes())

    def staged_bytes(self) -> int:
        return sum(r.receiver.staged_bytes() for r in self.rounds)

    def _forget(self, rid: int) -> None:
        """A request released or reset: what its earlier rounds took is let go (their chunks
        still due are received and dropped); a round with nothing left is let go too."""
        for r in self.rounds:
            if r.spans.pop(rid, None) is not None:
                r.receiver.drop(rid)
        self._let_go_empty()

    def _let_go_empty(self) -> None:
        """Rounds with no request left to write and no chunk still due are let go."""
        self.rounds = [r for r in self.rounds if r.spans or r.receiver.pending()]

    def step_spans(self, step: ExecuteStep) -> dict[int, tuple[int, int]]:
        """Before the head sends `step`: the requests it releases are forgotten, those it resets
        start again from their first block; returns request -> (first, stop) of the blocks
        the step fills (all their tokens computed once it ran), beyond those taken."""
        for rid in step.release:
            self.named.pop(rid, None)
            self._forget(rid)
        for u in step.blocks:
            if u.reset:
                self.named.pop(u.request_id, None)
                self._forget(u.request_id)
                self.generation[u.request_id] = self.generation.get(u.request_id, 0) + 1
        out, bs = {}, self.stage.block_size
        for w in step.seqs if self.abandoned is None else ():
            lo, hi = self.named.get(w.request_id, 0), (w.start + w.num_tokens) // bs
            if hi > lo:
                out[w.request_id] = (lo, hi)
        return out

    def pending(self) -> bool:
        """Whether a round's chunk is still due."""
        return any(r.receiver.pending() for r in self.rounds)

    def usable(self, seqs: Mapping[int, object]) -> dict[int, int]:
        """Request -> prefetched leading blocks the restore takes from here."""
        return {rid: n for rid, n in self.named.items()
                if n and rid in seqs and n <= len(seqs[rid].table)} if not self.abandoned else {}

    def abandon(self, why: str) -> None:
        """A member's rounds are zeros (its first could not be gathered: gpu/group_member.py
        `start_prefetch`): no round is named from now on, none is used (what the others took
        is let go; chunks still due are received and dropped: the tags go on), and the
        restore's step moves every block's KV."""
        if self.abandoned is None:
            self.abandoned = why
            for r in self.rounds:
                for rid in r.spans:
                    r.receiver.drop(rid)
                r.spans.clear()
            self.named.clear()
            self._let_go_empty()

    def write(self, full: torch.Tensor, request_id: int, blocks: Sequence[int]) -> None:
        """Its prefetched KV (the current generation's rounds) into `blocks` of the full view,
        its first blocks, as received."""
        gen = self.generation.get(request_id, 0)
        for r in self.rounds:
            lo, hi, g = r.spans.get(request_id, (0, 0, -1))
            if g == gen and lo < len(blocks):
                write_arrivals(full, blocks[lo:hi], r.receiver.wait(request_id))

    def void(self, spans: Mapping[int, tuple[int, int]]) -> None:
        """The step that named `spans` (its round) failed: what comes of that round is not
        used (a member that failed sends placeholders, to keep the chunks' numbers going on);
        those blocks are named again by a later step that fills them."""
        for rid, (lo, hi) in spans.items():
            for r in self.rounds:
                if r.spans.get(rid, (0, 0, -1))[:2] == (lo, hi):
                    del r.spans[rid]
                    r.receiver.drop(rid)
            if self.named.get(rid, 0) > lo:
                self.named[rid] = lo
        self._let_go_empty()

    def join(self, timeout: float) -> None:
        """Every round's chunks in (a dropped one's too: the tags go on). A member the data
        plane's watch knows is gone ends it at once (`GroupMemberLost`); chunks still due after
        `timeout` seconds end it with a plain error naming them (not a loss: the member may
        live, and nothing of the restore has begun)."""
        deadline = time.monotonic() + timeout
        for k, r in enumerate(self.rounds):
            while not r.receiver.join(WATCH_SLICE_S):
                if gone := known_lost(self.ranks[1:]):
                    raise lost_error(gone[0], "its prefetched KV was due")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the restore's prefetched KV: round {k} of {len(self.rounds)} still "
                        f"waits for requests {sorted(r.receiver.pending())} from members "
                        f"{[self.ranks[m] for m in r.receiver.sources]} after {timeout:g} s")

    def close(self) -> None:
        """Its receiving threads end (after the chunks due; one blocked in a receive on a
        broken group's channel ends with it)."""
        for w in self.workers.values():
            w.close()

    def report(self) -> dict:
        return {"kv_abandoned": self.abandoned, "kv_rounds": float(self.later[0]),
                "kv_resets": float(sum(self.generation.values())),
                "kv_round_blocks": float(self.later[1]),
                "kv_staged_peak_bytes": float(self.staged_peak),
                "kv_recv_threads": float(self.threads)}


def send_kv_round(stage, ranks: Sequence[int], me: int, layers: Sequence[range],
                  spans: Mapping[int, tuple[int, int]], chunk_blocks: int,
                  placeholder: bool = False) -> None:
    """A member: its layers of the blocks the head named (request -> (first, stop)), gathered
    now and queued (kind kv) to the head, the chunks' numbers going on from the last round's
    (`stage.kv_seq`). `placeholder`: the step that named them failed here; zeros of the same
    shapes go instead (the head posted their receives; it voids the round, `KvPrefetch.void`),
    so the next round's numbers still match the head's."""
    counts = {rid: hi - lo for rid, (lo, hi) in spans.items()}

    def gather(t: KvTransfer) -> torch.Tensor:
        if placeholder:
            return torch.zeros((t.blocks, len(t.layers), *block_shape(stage)),
                               dtype=stage.model.arena.dtype)
        return stage.read_layers(stage.seqs[t.request_id].table[slice(*spans[t.request_id])])

    send_transfers(stage.plane, ranks, me, prefetch_transfers(counts, layers), chunk_blocks,
                   KV_EPOCH, gather, stage.stats, seq_base=stage.kv_seq)
    stage.kv_seq += round_chunks(counts, layers, chunk_blocks)


def send_kv_prefetch(stage, ranks: Sequence[int], me: int, layers: Sequence[range],
                     blocks: Mapping[int, int], chunk_blocks: int,
                     placeholder: bool = False) -> None:
    """A member: its layers of the full blocks the head named as the prefetch began (the
    first round; `placeholder`: zeros, `send_kv_round`)."""
    stage.kv_seq = 0
    send_kv_round(stage, ranks, me, layers, {rid: (0, n) for rid, n in blocks.items()},
                  chunk_blocks, placeholder)


def write_arrivals(full: torch.Tensor, blocks: Sequence[int], arrivals) -> None:
    """Into `blocks` of the full view: each member's layers as they arrive ((transfer, data)
    pairs), their first len(blocks) blocks."""
    n = len(blocks)
    idx = torch.tensor(blocks, dtype=torch.long, device=full.device)
    for t, data in arrivals:
        full[idx, t.layers.start:t.layers.stop] = data[:n].to(full.device)
