"""The head's side of a pipeline group's restore at its step (KunServe §4.4): the members are
told (`GroupRestore`), the KV of every live request's blocks not prefetched moves to the head
(gpu/restore_kv.py: the KV and the rounds prefetched while the group served; gpu/kept_kv.py: the
head's own kept layers), the weights come back (gpu/restore_prefetch.py), and the head's runner
holds every request again with the solo tables its engine chose.

Before it changes anything (no member told, no request released, no weight back) it checks what
can fail without a loss: a solo table for every live request, and every prefetched KV round in
(`KvPrefetch.join`, at most `KV_JOIN_S`). Either failing raises `RestoreNotStarted`: the group is
as it was and serves on (gpu/kunserve_runner.py tries the restore again at its next steps, a
bounded number of times). The prefetched rounds are used only when every member answered a step
since the prefetch began (`GroupRunner.prefetch_heard`: each answer says whether its rounds are
its KV, `MemberReply.kv_void`) and none said they are zeros; otherwise every block's KV moves at
the step, as in a one-step restore.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence

import torch

from gpu.data_plane import CONTROL_TAG, REPLY_TAG, GroupMemberLost
from gpu.group_messages import GroupRestore, MemberReply, restored_generator
from gpu.kept_kv import own_moves, place_own
from gpu.kv_exchange import KvReceiver
from gpu.kv_moved import count_moved
from gpu.restore_kv import KV_JOIN_S, block_shape, restore_transfers, write_arrivals
from gpu.restore_prefetch import prefetch_report, restore_weights

RESTORE_FAULT_ENV = "SHUNTER_RESTORE_FAULT"
"""Tests' fault (an error, not a loss) where the restore waits for its prefetched rounds:
`join@<rank>` once, `join-always@<rank>` every time (the head's rank)."""


class RestoreNotStarted(RuntimeError):
    """A restore that failed before it changed anything: the group serves on as it was."""


def _fault(rank: int) -> None:
    fault = os.environ.get(RESTORE_FAULT_ENV)
    if fault in (f"join@{rank}", f"join-always@{rank}"):
        if fault == f"join@{rank}":
            del os.environ[RESTORE_FAULT_ENV]  # (once)
        raise RuntimeError("the test's fault: the restore's prefetched KV rounds were late")


def restore_group(runner, tables: Mapping[int, Sequence[int]], source: str,
                  release: Sequence[int]) -> None:
    """`GroupRunner.restore` (gpu/group_runner.py): solo again, each live request with its
    table in `tables`. Raises `RestoreNotStarted` when it fails before it changed anything."""
    import gpu.group_runner as gr  # (its send_obj/recv_obj: stand-ins replace them there)

    began, stage = time.perf_counter(), runner.stage
    received = stage.stats.received_bytes
    kv = stage.kv_prefetch
    host = stage.host_bytes if kv is None else kv.began_host
    missing = set(stage.seqs) - set(release) - set(tables)
    if missing:
        raise RestoreNotStarted(f"restore needs a solo table for every live request; missing "
                                f"{sorted(missing)}")
    staged = kv.staged_bytes() if kv is not None else 0
    try:  # every prefetched round in before anything changes (members told, weights back)
        _fault(stage.plane.rank)
        if kv is not None:
            kv.join(KV_JOIN_S)
    except GroupMemberLost:
        raise
    except RuntimeError as exc:
        raise RestoreNotStarted(str(exc)) from exc
    for rid in release:
        stage.seqs.pop(rid, None)
    for rid in stage.seqs:  # (as each member does: exchanged KV no step placed yet)
        stage._place(rid)
    for t in runner._fed_back:  # the head is not the last stage: tokens it has not appended
        if t.request_id in stage.seqs:
            stage.seqs[t.request_id].tokens.append(t.token_id)
    runner._fed_back = ()  # (a loss below: `recover_from_host` must not append them again)
    heard = len(runner.prefetch_heard) == len(runner.ranks) - 1
    skip = kv.usable(stage.seqs) if kv is not None and heard else {}
    msg = GroupRestore(tables={r: tuple(t) for r, t in tables.items()}, source=source,
                       release=tuple(release), skip=skip)
    for rank in runner.ranks[1:]:
        gr.send_obj(msg, rank, CONTROL_TAG, "the group was restored")
    receiver = KvReceiver(runner.ranks, 0, restore_transfers(stage.seqs, runner.layers, skip),
                          runner.chunk_blocks, 1, block_shape(stage), stage.model.arena.dtype,
                          stage.stats, link=stage.plane)
    src, dst, in_place = own_moves(stage, tables)
    placed = place_own(stage, src, dst)  # before the weights come back over any
    if placed is not None:
        src, dst, in_place = [], [], in_place + len(src)
    own = stage.gather_layers(src)  # (none placed: gathered on the device, outside the arena)
    w_began = time.perf_counter()
    weights_at = restore_weights(stage, runner.ranks, runner.layers, source)
    weights_s = time.perf_counter() - w_began
    arena = stage.model.arena
    full, keep = arena.kv, stage.keep  # [blocks, L, 2, bs, H, D], the full view again
    full[torch.tensor(dst, dtype=torch.long, device=full.device), keep.start:keep.stop] = own
    if kv is not None:
        kv.close()
    for rid, s in stage.seqs.items():
        new = list(tables[rid])
        n = min(len(new), len(s.table))
        k = min(skip.get(rid, 0), n)
        if k:  # the first blocks: moved while the group served
            kv.write(full, rid, new[:k])
        write_arrivals(full, new[k:n], receiver.wait(rid) if receiver.expects(rid) else ())
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
                            "own_kv_arena_copies": float(len(placed or ())),
                            "kv_staged_bytes": float(staged),
                            "prefetch_fallbacks": dict(runner.prefetch_fallbacks),
                            **prefetch_report(stage), **(kv.report() if kv else {})}
    stage.end_exchange()
    runner.stage = None


