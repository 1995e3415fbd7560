"""The KV exchange of a KunServe group forming on the simulator's instances (§4.2), as the torch
backend moves it, and when a restore may start after it.

What moves: every waiting request's KV for the layers other members keep, over its source's
link (the member that served it alone, or the head for its own requests), in whole blocks as
the torch members send them (gpu/group_messages.py `start_transfers`: an adopted request's
ceil(computed tokens / block size) blocks, the head's own its table's, the same count): a
request's partly filled last block goes whole. Activations wait for it as the policy's
`kv_exchange` says (sim/exchange.py); each request waits only for its own bytes.

A re-split (a running group grows, or groups merge): the members that now keep layers they had
dropped get them first, from their host copies at a merge, from the new member at a growth; the
group's steps wait for them (`merge_load_s`).

When it has settled: once the head's scheduler has every request's arrival (`Formation`). A
restore waits for that first (`settled`, as shunter/cluster/instance_restore.py `_settled`
does on torch), for at most `SETTLE_S`; one that waits longer is refused as a pool too small
is, and the coordinator asks again in a later round.
"""

from __future__ import annotations

import anyio
import attrs

from engine.cluster.drop_plan import GroupPlan
from engine.messages import SwapDone
from sim.arena_layout import layer_blocks
from sim.exchange import SimExchange
from sim.profile import ModelShape

POLL_S = 0.005
"""How often a restore looks whether its group's exchange has settled (torch's `POLL_S`)."""
SETTLE_S = 10.0
"""How long a restore waits for it before it is refused (torch's `SETTLE_S`)."""


@attrs.define
class Formation:
    """A group's formation exchange at its head: the requests whose KV is still on its way."""

    pending: set[int]
    settled_at: float | None = None
    """When the last of them arrived (None: some still wait)."""

    def __attrs_post_init__(self) -> None:
        if not self.pending:
            self.settled_at = anyio.current_time()

    def arrived(self, rid: int) -> None:
        self.pending.discard(rid)
        if not self.pending and self.settled_at is None:
            self.settled_at = anyio.current_time()


def exchange_bytes(model: ModelShape, block_size: int, tokens: int, layers: int) -> int:
    """What a member sends of one request at a group's formation: the blocks holding its
    `tokens` computed tokens, of `layers` layers (a block of one layer holds K and V of
    `block_size` tokens)."""
    return -(-tokens // block_size) * layers * model.block_bytes(block_size) // model.num_layers


def exchange(groups, g: GroupPlan, waiting, sources: dict[int, int]) -> None:
    """Start `g`'s exchange for the head's `waiting` requests (`sources`: request -> the member
    whose KV it is; the head for the rest), one `SimExchange` per source, under `groups`'
    (shunter/cluster/groups.py `SimGroups`) task group."""
    model = groups.model
    queues: dict[int, list[tuple[int, int]]] = {}
    for q in waiting:
        src = sources.get(q.id, g.head)
        moved = model.num_layers - len(g.layers[g.members.index(src)])
        queues.setdefault(src, []).append(
            (q.id, exchange_bytes(model, groups.block_size, q.computed_tokens, moved)))
    head = groups.instances[g.head].engine
    net = head.backend.runner.network
    net.exchanges = []
    formation = groups.exchanging[g.head] = Formation(
        pending={rid for queue in queues.values() for rid, _ in queue})
    epoch = groups.faults.get(g.head, 0)

    async def arrived(rid: int) -> None:
        if groups.faults.get(g.head, 0) == epoch:  # after a fault they are recomputed
            await head._scheduler_send.send(SwapDone(request_ids=(rid,)))
        formation.arrived(rid)  # (once it is in the scheduler's inbox, ahead of a restore's)

    for queue in queues.values():
        x = SimExchange(groups.link, coordinated=groups.coordinated)
        net.exchanges.append(x)
        groups.counters.kv_exchanged_bytes += sum(b for _, b in queue)
        groups._tg.start_soon(x.run, queue, arrived)


def gained_layers(g: GroupPlan, before: dict[int, range]) -> list[int]:
    """Layers each member of `g` keeps that it did not hold before (`before`: each member of a
    group that ran, its layers there; an instance alone held every layer)."""
    return [len(set(r) - set(before.get(m, r))) for m, r in zip(g.members, g.layers)]


def merge_load_s(groups, g: GroupPlan, before: dict[int, range], merge: bool) -> float:
    """How long `g`'s members take to get the layers they gain at a re-split, as torch's do:
    in a `merge` of running groups (gpu/group_merge.py) each from its host copy, over its own
    host link (a pair-to-four merge of Llama-3-8B: two members, 8 layers each, 3.5 GB, 0.11 s
    at 32 GB/s): the slowest member's; in a growth (gpu/group_grow.py, `PEER_GAINS`) from the
    first new member, which holds every layer, over its pipeline link, one after another."""
    per = layer_blocks(groups.model, groups.block_size) * groups.block_bytes
    gained = gained_layers(g, before)
    if not any(gained):
        return 0.0
    if merge:
        host = groups.host_link()
        return max(host.send_s(n * per) for n in gained if n)
    return groups.link.send_s(sum(gained) * per)


async def settled(groups, g: GroupPlan) -> float | None:
    """Wait until no live request of `g`'s head still waits for its formation KV; returns the
    seconds waited, or None after `SETTLE_S` (the restore is refused). Returns at once when
    `g` is no longer the head's group (a fault dissolved it)."""
    head = groups.instances[g.head].engine
    began = anyio.current_time()
    while True:
        formation = groups.exchanging.get(g.head)
        if formation is None or not formation.pending or groups.groups.get(g.head) is not g:
            return anyio.current_time() - began
        live = set((await head.inspect()).scheduler.live_requests)
        if not formation.pending & live:
            return anyio.current_time() - began
        if anyio.current_time() - began >= SETTLE_S:
            return None
        await anyio.sleep(POLL_S)
