"""KunServe's restore (§4.4) on the simulator's instances, as the policy's `memory { }` says
(engine/cluster/group_settings.py): each member gets back the weights of the layers it dropped
and the head the KV of the live requests for the layers it gains (the members held it); then the
head's pool shrinks back (only once its requests fit; with the prefetch before anything moves,
as on torch) and every member serves alone again. It moves what the torch backend moves, and
when (gpu/restore_prefetch.py, gpu/restore_kv.py, its `restore_stats`: weight_bytes_at,
kv_bytes_before, kv_bytes_at). It starts once the group's formation exchange has settled
(sim_formation.py `settled`, as torch's `_settled`: at most 10 s, else refused as a pool too
small is, and asked again in a later round).

What moves, per member m with layers r_m of L, a block of B bytes (every layer's KV):
- weights: `layer x (L - |r_m|)` (the head's own dropped layers too), a layer's weights in
  whole arena blocks as torch lays them out (`layer_weight_bytes`: 209 blocks, 438.3 MB, of
  Llama-3-8B; its global tensors, 2.1 GB, stay on every member);
- KV (members other than the head): m's layers, `B x |r_m| / L` a block, of each live
  request's blocks holding its computed tokens, ceil(tokens / block size), as the head's record
  of the grouped steps it sent says (`GroupNetwork.computed`, sim/group.py; the torch head's
  `note_step`).

Where it comes from (`restore_from`): `peer`, everything over m's pipeline link (sim/network.py,
latency + bytes / bandwidth fitted to Vidur's send/recv times, a100-internode 7.83 GB/s by
default); `host`, the weights over m's host <-> device link instead (the profile's copy link,
`SimGroups.host_link`: its bandwidth, 32 GB/s PCIe 4.0 x16 in the shipped profiles,
sim/copy_costs.py; no per-call cost, as a fault's reload, sim_faults.py), the KV still over the
pipeline link, the two in parallel.

When (`restore_prefetch`): `on`, while the group serves, the pipeline link's share as an
exchange its activations go before (sim/exchange.py): the weights and every live request's full
blocks at once, then with each grouped step the blocks it fills (`GroupNetwork.on_fill`), until
nothing is left in flight; then the restore's step moves the rest, each live request's partly
filled last block (the torch backend's rounds, kun-delta's design, s31). `off`: everything at
the restore's step. Either way the group stops at the end of its step in flight (or now, if
idle) and the head's first step alone starts when the slowest member's copies at the step have
landed (`GroupNetwork.hold`): copy_m = link(w_m + kv_m) from peers, max(host(w_m), link(kv_m))
from the host (the prefetch leaves w_m = 0 there), the head's kv being every member's (it takes
them all over its one link; since s32: each member's was charged on its own link before). A
member lost before they land: sim_faults.py (one fault: the head recomputes and reloads from its
host copy; no restore).
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import attrs
import structlog

from engine.cluster.adoption import PoolTooSmall
from engine.cluster.drop_plan import GroupPlan
from engine.cluster.messages import GroupsChanged
from engine.messages import Regroup
from shunter.cluster.sim_formation import settled
from sim.arena_layout import layer_blocks
from sim.exchange import SimExchange
from sim.network import NetworkLink

log = structlog.get_logger(actor="coordinator")

POLL_S = 0.005
"""How often the restore asks whether its head is idle while it waits for the step carrying the
pool's shrink (the torch front door's poll, shunter/cluster/instance_restore.py)."""


def layer_weight_bytes(model, block_bytes: int) -> int:
    """One decoder layer's weights as the torch arena holds them: from a fresh block boundary,
    whole blocks (sim/arena_layout.py, as gpu/arena.py `plan_layout`). The global tensors (embeddings,
    LM head, final norm) are no layer's: every member keeps them (gpu/stage_view.py
    `kept_weight_ranges`)."""
    block_size = block_bytes // model.kv_bytes_per_token
    return layer_blocks(model, block_size) * block_bytes


def restore_bytes(groups, g: GroupPlan, blocks: int) -> tuple[list[int], list[int]]:
    """(weights, KV) bytes each member of `g` gets back or sends, in member order, for `blocks`
    of the head's requests' KV (every layer's)."""
    layers = groups.model.num_layers
    per_layer = layer_weight_bytes(groups.model, groups.block_bytes)
    weights, kv = [], []
    for m, r in zip(g.members, g.layers):
        weights.append(per_layer * (layers - len(r)))
        kv.append(int(blocks * groups.block_bytes * len(r) / layers) if m != g.head else 0)
    return weights, kv


def kv_blocks(computed: Mapping[int, int], sent: Mapping[int, int], block_size: int) -> int:
    """The live requests' blocks not at the head yet: each one's blocks holding its `computed`
    tokens after the leading `sent` ones."""
    return sum(max(0, -(-c // block_size) - sent.get(rid, 0)) for rid, c in computed.items())


def _send_s(link: NetworkLink, nbytes: int) -> float:
    return link.send_s(nbytes) if nbytes else 0.0


def one_step_s(link: NetworkLink, host: NetworkLink | None, weights: list[int],
               kv: list[int]) -> float:
    """How long the restore's step stops the group: the slowest member's copies then (`host`
    None: its weights from peers, over its pipeline link with its KV). The head (member 0)
    receives every member's KV over its one link, as torch's head does (gpu/restore_kv.py):
    its copies are its own weights and all of the members' KV (in a group of four, three
    members' share through one link)."""
    into_head = [sum(kv)] + list(kv[1:])
    return max((_send_s(link, w + k) if host is None
                else max(_send_s(host, w), _send_s(link, k))
                for w, k in zip(weights, into_head)), default=0.0)


@attrs.define
class OneStep:
    """A one-step restore under way at a group's head (`SimGroups.one_step`): whether its
    `Regroup(solo)` took (`solo`, once `decided`). A member lost before the copies land finds
    the head solo already (sim_faults.py `recover`: no second switch, its hold moved)."""

    decided: anyio.Event = attrs.field(factory=anyio.Event)
    solo: bool = False

    def decide(self, solo: bool) -> None:
        self.solo = solo
        self.decided.set()


async def restore(groups, g: GroupPlan, ask) -> None:
    """`g`'s layers and KV back as the policy says; then it dissolves (or waits for the next
    round, when the head's requests do not fit its own pool)."""
    began = anyio.current_time()
    settle_s = await settled(groups, g)  # the formation's KV in first, as on torch
    if settle_s is None:
        await _postponed(groups, g, PoolTooSmall(
            f"group {list(g.members)} cannot restore yet: requests "
            f"{sorted(groups.exchanging[g.head].pending)} still wait for its KV exchange"))
        return
    if groups.groups.get(g.head) is not g:
        return  # a member was lost meanwhile: sim_faults.py dissolves the group
    head = groups.instances[g.head].engine
    pool = (await head.inspect()).scheduler
    used = pool.total_blocks - pool.free_blocks
    weights, _ = restore_bytes(groups, g, 0)
    host = groups.host_link() if groups.restore_from == "host" else None
    net = head.backend.runner.network
    late = [0] * len(g.members)  # KV of blocks named after a member's exchange drained
    before = [0] * len(g.members)
    base = groups.base_pools[g.head]
    try:
        if groups.restore_prefetch:
            # as the torch head (shunter/cluster/instance_restore.py): the pool shrinks back
            # first, the group kept, and the copies start once the head's requests fit it
            try:
                await ask(head._scheduler_send, lambda r: Regroup(pool_blocks=base, reply=r))
            except PoolTooSmall as exc:
                await _postponed(groups, g, exc)
                return
            shrunk = net.noted  # the copies start once the step carrying the shrink ran (its
            while not await net.stepped(shrunk, POLL_S):  # tables moved), or now if idle
                if (groups.groups.get(g.head) is not g
                        or not (await head.inspect()).scheduler.live_requests):
                    break
            if groups.groups.get(g.head) is not g:
                return  # a member was lost before the copies began: sim_faults.py dissolved it
            before = await _while_serving(groups, g, net, weights, host, late)
            weights_at = [0] * len(weights)
        else:
            weights_at = weights
        if groups.groups.get(g.head) is not g:
            return  # a member was lost (meanwhile): sim_faults.py dissolves the group

        def at_step() -> tuple[list[int], float]:  # (KV per member, stall) at the restore's step
            _, kv = restore_bytes(groups, g, kv_blocks(net.computed, net.named or {},
                                                       groups.block_size))
            kv = [k + x for k, x in zip(kv, late)]
            return kv, one_step_s(groups.link, host, weights_at, kv)

        decided = anyio.current_time()
        kv_at, stall = at_step()
        net.hold_to(max(decided, net.stepped_until) + stall, "restore")
        window = groups.one_step[g.head] = OneStep()
        solo = GroupPlan(group_id=-1, members=(g.head,), layers=(range(groups.model.num_layers),))
        try:  # (prefetched: the pool is its own already)
            await ask(head._scheduler_send, lambda r: Regroup(
                pool_blocks=None if groups.restore_prefetch else base, group=solo, reply=r))
        except PoolTooSmall as exc:
            net.hold_to(0.0, "restore")  # nothing stopped: the restore is tried again next round
            groups.one_step.pop(g.head, None)
            window.decide(False)
            await _postponed(groups, g, exc)
            return
        # no grouped step runs any more: what the restore's step moves is known (a step that
        # began after the decision moved the stop and added its blocks)
        kv_at, stall = at_step()
        stop = max(decided, net.stepped_until)
        net.hold_to(stop + stall, "restore")
    finally:
        net.named = net.on_fill = None
    window.decide(True)
    await net.held()  # the copies at the step (a member lost meanwhile moves it: its reload)
    if groups.one_step.get(g.head) is window:
        del groups.one_step[g.head]
    if groups.groups.get(g.head) is not g:
        return
    del groups.groups[g.head]
    await groups.coordinator.send(GroupsChanged(restored=g.head))
    c = groups.counters
    c.restores += 1
    kv_before, kv_step = sum(before), sum(kv_at)
    copied = sum(weights) + kv_before + kv_step
    c.events.append({"t": anyio.current_time(), "event": "restore", "members": list(g.members),
                     "copied_bytes": copied, "weight_bytes": sum(weights),
                     "weight_bytes_at": sum(weights_at), "kv_bytes": kv_before + kv_step,
                     "kv_bytes_before": kv_before, "kv_bytes_at": kv_step,
                     "used_blocks": used, "kept_layers": [len(r) for r in g.layers],
                     "prefetched": groups.restore_prefetch,
                     "source": groups.restore_from, "stall_s": stall,
                     "stopped": stop, "settle_s": settle_s,
                     "restore_s": anyio.current_time() - began})
    log.info("group restored", members=g.members, copied_bytes=copied)


async def _postponed(groups, g: GroupPlan, exc: PoolTooSmall) -> None:
    groups.counters.restore_retries += 1
    log.info("restore postponed", head=g.head, why=str(exc))
    await groups.coordinator.send(GroupsChanged())  # keep the restore trigger armed


async def _while_serving(groups, g: GroupPlan, net, weights: list[int],
                         host: NetworkLink | None, late: list[int]) -> list[int]:
    """The copies while the group serves, until none is left in flight: each member's over its
    pipeline link as an exchange (its weights too, from peers; the weights over its host link
    beside it, from the host), the KV of every live request's full blocks first, then of the
    blocks each grouped step fills (`late` when they are named after the member's exchange
    drained: sent in a further pass, or at the step). Returns the KV bytes sent per member."""
    bs = groups.block_size
    net.named = {rid: c // bs for rid, c in net.computed.items()}
    _, kv = restore_bytes(groups, g, sum(net.named.values()))
    sent = list(kv)
    queue = [k + (w if host is None else 0) for w, k in zip(weights, kv)]
    net.exchanges = xs = [SimExchange(groups.link, coordinated=groups.coordinated)
                          for _ in queue]

    def fill(blocks: int) -> None:
        for i, k in enumerate(restore_bytes(groups, g, blocks)[1]):
            if k and not xs[i].add(-1, k):
                late[i] += k
            elif k:
                sent[i] += k

    async def nothing(_: int) -> None:
        return None

    net.on_fill = fill
    with anyio.CancelScope() as scope:  # cancelled by a member's loss (SimGroups.act)
        groups.prefetching[g.head] = scope
        try:
            while any(queue):
                async with anyio.create_task_group() as tg:
                    for x, nbytes in zip(xs, queue):
                        if nbytes:
                            tg.start_soon(x.run, [(-1, nbytes)], nothing)
                    if host is not None:
                        for w in weights:
                            tg.start_soon(anyio.sleep, host.send_s(w))
                        host = None  # (once)
                    weights = [0] * len(weights)
                for i, k in enumerate(late):
                    sent[i] += k
                queue, late[:] = list(late), [0] * len(late)
        finally:
            if groups.prefetching.get(g.head) is scope:
                del groups.prefetching[g.head]
    return sent
