"""The head's side of a pipeline group's restore (KunServe §4.4) and the KV it moves: every live
request's KV of the members' layers comes to the head and is written into the solo tables its
engine chose. The head's own kept layers of a block already lie in that block's solo place when
its stage block's base is the solo block's (a block the head held before the group formed and
whose id did not move: gpu/stage_view.py `StageView.base`); every other block's are copied on
the device (gathered before the weights come back over the dropped memory, then written into the
solo blocks): none goes through host memory (`own_kv_host_bytes`).

With a restore prefetch (gpu/restore_prefetch.py) the KV of every *full* block moves before the
restore's step too: a block whose tokens are all computed never changes again while its request
lives and keeps its table (decoding writes only the last block; a request preempted (its table
reset) or ended since is not taken from what was prefetched). The head names, per request, how
many leading blocks are full (`GroupPrefetch.kv_blocks`, from the tokens its steps computed),
reads its own kept layers of them to the host, and receives the members' over the channel
(chunks on the KV lane behind activations, tag epoch `KV_EPOCH`); the restore's step then moves
only the blocks after them (`GroupRestore.skip`) and writes the prefetched ones as received.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from engine.messages import ExecuteStep
from gpu.data_plane import CONTROL_TAG, REPLY_TAG
from gpu.group_messages import GroupRestore, MemberReply, restored_generator
from gpu.kv_exchange import KvReceiver, KvTransfer, send_transfers
from gpu.kv_moved import count_moved
from gpu.restore_prefetch import prefetch_report, restore_weights

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


def note_step(computed: dict[int, int], stage, step: ExecuteStep) -> None:
    """The head's record of each request's computed tokens (whose KV every member wrote), and
    a prefetch's requests whose blocks changed (reset) since it took them."""
    for w in step.seqs:
        computed[w.request_id] = w.start + w.num_tokens
    kv = stage.kv_prefetch
    for u in step.blocks:
        if u.reset and kv is not None:
            kv.stale.add(u.request_id)


def _block_shape(stage) -> tuple[int, ...]:
    c = stage.model.config
    return (2, stage.block_size, c.num_kv_heads, c.head_dim)


def full_blocks(stage, computed: Mapping[int, int]) -> dict[int, int]:
    """Each live request's leading blocks whose every token is computed (`computed`: tokens
    with KV written, `note_step`)."""
    bs = stage.block_size
    return {rid: n for rid, s in stage.seqs.items()
            if (n := min(computed.get(rid, 0) // bs, len(s.table)))}


class KvPrefetch:
    """The head's prefetched KV of full blocks: the members' layers, arriving (its own stay on
    its device until the restore's step)."""

    def __init__(self, stage, ranks: Sequence[int], layers: Sequence[range], chunk_blocks: int,
                 blocks: Mapping[int, int]) -> None:
        self.blocks = dict(blocks)
        """Request -> its leading full blocks taken now (`full_blocks`)."""
        self.began_host = stage.host_bytes  # (the head's own KV read to host since: none)
        self.stale: set[int] = set()
        """Requests whose table was reset since: their prefetched KV is not used."""
        self.began_bytes = stage.stats.received_bytes
        self.receiver = KvReceiver(ranks, 0, prefetch_transfers(self.blocks, layers),
                                   chunk_blocks, KV_EPOCH, _block_shape(stage),
                                   stage.model.arena.dtype, stage.stats, link=stage.plane)

    def usable(self, seqs: Mapping[int, object]) -> dict[int, int]:
        """Request -> prefetched leading blocks the restore takes from here."""
        return {rid: n for rid, n in self.blocks.items()
                if rid in seqs and rid not in self.stale and n <= len(seqs[rid].table)}


def send_kv_prefetch(stage, ranks: Sequence[int], me: int, layers: Sequence[range],
                     blocks: Mapping[int, int], chunk_blocks: int) -> None:
    """A member: its layers of the full blocks the head named, gathered now and queued (kind
    kv) to the head."""
    send_transfers(stage.plane, ranks, me, prefetch_transfers(blocks, layers), chunk_blocks,
                   KV_EPOCH, lambda t: stage.read_layers(stage.seqs[t.request_id].table[:t.blocks]),
                   stage.stats)


def restore_group(runner, tables: Mapping[int, Sequence[int]], source: str,
                  release: Sequence[int]) -> None:
    """`GroupRunner.restore` (gpu/group_runner.py): solo again, each live request with its
    table in `tables`."""
    import gpu.group_runner as gr  # (its send_obj/recv_obj: stand-ins replace them there)

    began, stage = time.perf_counter(), runner.stage
    received = stage.stats.received_bytes
    kv = stage.kv_prefetch
    host = stage.host_bytes if kv is None else kv.began_host
    for rid in release:
        stage.seqs.pop(rid, None)
    for t in runner._fed_back:  # the head is not the last stage: tokens it has not appended
        if t.request_id in stage.seqs:
            stage.seqs[t.request_id].tokens.append(t.token_id)
    missing = set(stage.seqs) - set(tables)
    if missing:
        raise ValueError(f"restore needs a solo table for every live request; missing "
                         f"{sorted(missing)}")
    skip = kv.usable(stage.seqs) if kv is not None else {}
    msg = GroupRestore(tables={r: tuple(t) for r, t in tables.items()}, source=source,
                       release=tuple(release), skip=skip)
    for rank in runner.ranks[1:]:
        gr.send_obj(msg, rank, CONTROL_TAG, "the group was restored")
    receiver = KvReceiver(runner.ranks, 0, restore_transfers(stage.seqs, runner.layers, skip),
                          runner.chunk_blocks, 1, _block_shape(stage), stage.model.arena.dtype,
                          stage.stats, link=stage.plane)
    src, dst, in_place = own_moves(stage, tables)
    own = stage.gather_layers(src)  # on the device, before the weights come back over any
    w_began = time.perf_counter()
    weights_at = restore_weights(stage, runner.ranks, runner.layers, source)
    weights_s = time.perf_counter() - w_began
    arena = stage.model.arena
    full, keep = arena.kv, stage.keep  # [blocks, L, 2, bs, H, D], the full view again
    full[torch.tensor(dst, dtype=torch.long, device=full.device), keep.start:keep.stop] = own
    if kv is not None:
        kv.receiver.join()  # every prefetched chunk in (a stale one's too: the tags go on)
    for rid, s in stage.seqs.items():
        new = list(tables[rid])
        n = min(len(new), len(s.table))
        k = min(skip.get(rid, 0), n)
        if rid in skip:  # the first blocks: moved while the group served
            _write(full, new[:k], kv.receiver.wait(rid))
        _write(full, new[k:n], receiver.wait(rid) if receiver.expects(rid) else ())
        runner.solo._seqs[rid] = gr._solo_seq(runner.solo, s, new)
    for rank in runner.ranks[1:]:
        reply: MemberReply = gr.recv_obj(rank, REPLY_TAG, "its layers were restored")
        if reply.error is not None:
            raise RuntimeError(f"pipeline group member instance {rank}: {reply.error}")
        for rid, state in (reply.generator_states or {}).items():
            seq = runner.solo._seqs.get(rid)
            if seq is not None:  # the last member sampled: its generator goes on here
                seq.generator = restored_generator(seq.sampling, rid, arena.device, state)
    at = stage.stats.received_bytes - received
    before = received - kv.began_bytes if kv is not None else 0
    count_moved(runner.solo, at + before)
    runner.restore_stats = {"source": source, "seconds": time.perf_counter() - began,
                            "weights_s": weights_s,
                            "kv_bytes": float(before + at), "kv_bytes_before": float(before),
                            "kv_bytes_at": float(at),
                            "weight_bytes_at": float(weights_at),
                            "own_kv_host_bytes": float(stage.host_bytes - host),
                            "own_kv_device_bytes": float(own.numel() * own.element_size()),
                            "own_kv_in_place_blocks": float(in_place),
                            **prefetch_report(stage)}
    stage.end_exchange()
    runner.stage = None


def own_moves(stage, tables: Mapping[int, Sequence[int]]) -> tuple[list[int], list[int], int]:
    """The head's kept layers at the restore: (stage blocks to copy from, solo blocks to copy
    into, blocks already in place). A block is in place when its stage block's layers lie where
    its solo block's do (`base` = solo block x layers)."""
    view, layers = stage.model.drop_state.view, stage.model.config.num_layers
    src, dst, in_place = [], [], 0
    for rid, s in stage.seqs.items():
        new = tables[rid]
        for local, block in zip(stage.map.locals(s.table[:len(new)]), new):
            if view.base(local) == block * layers:
                in_place += 1
            else:
                src.append(local)
                dst.append(block)
    return src, dst, in_place


def _write(full: torch.Tensor, blocks: Sequence[int], arrivals) -> None:
    """Into `blocks` of the full view: each member's layers as they arrive ((transfer, data)
    pairs), their first len(blocks) blocks."""
    n = len(blocks)
    idx = torch.tensor(blocks, dtype=torch.long, device=full.device)
    for t, data in arrivals:
        full[idx, t.layers.start:t.layers.stop] = data[:n].to(full.device)
