"""The messages of a pipeline group formed at run time (KunServe §4.1-4.4) between its head
(gpu/group_runner.py) and its members (gpu/group_member.py), each member's `GroupStage` (gpu/
group_stage.py) built from them: what a group starts with (`GroupStart`, its requests and
those adopted from members), each step's cut (`GroupStep`), a member's answer (`MemberReply`),
and how the group ends (`GroupRestore`, `GroupAbandon`); and the KV transfers a `GroupStart`
implies (`start_transfers`), which the head counts and every member sends and receives.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from engine.cluster.stage_fits import Cut
from engine.messages import SampledToken
from engine.params import SamplingParams
from gpu.kv_exchange import KvTransfer
from gpu.pipeline_stage import StageStep
from gpu.sampler import make_generator

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
    kv_spans: tuple[tuple[int, int, int], ...] = ()
    """While a restore is prefetched: (request, first block, stop block) of the blocks this step
    fills; each member sends the head its layers of them once it ran the step
    (gpu/restore_kv.py)."""


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
    kv_void: str | None = None
    """Why its prefetch's KV rounds are zeros (the head uses none of them: gpu/restore_kv.py
    `KvPrefetch.abandon`); None: they are its KV."""
    weights_from_host: str | None = None
    """Why it could not vacate: its weights come from its host copy at the restore's step."""


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
