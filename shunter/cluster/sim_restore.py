"""KunServe's restore (§4.4) on the simulator's instances, as the policy's `memory { }` says
(engine/cluster/group_settings.py): each member gets back the weights of the layers it dropped
and the head the KV of the live requests for the layers it gains (the members held it); then the
head's pool shrinks back (only once its requests fit) and every member serves alone again.

What moves, per member m with layers r_m of L (the same bytes whichever way it goes):
- weights: `weight_bytes / L x (L - |r_m|)` (the head's own dropped layers too);
- KV (members other than the head): `used blocks x block bytes x |r_m| / L`, the head's live
  requests' KV for m's layers.

Where it comes from (`restore_from`): `peer`, everything over m's pipeline link (sim/network.py,
latency + bytes / bandwidth fitted to Vidur's send/recv times, a100-internode 7.83 GB/s by
default); `host`, the weights over m's host <-> device link instead (the profile's copy link,
`SimGroups.host_link`: its bandwidth, 32 GB/s PCIe 4.0 x16 in the shipped profiles,
sim/copy_costs.py; no per-call cost, as a fault's reload, sim_faults.py), the KV still over the
pipeline link, the two in parallel.

When (`restore_prefetch`): `on`, the copies run while the group serves, the pipeline link's
share as an exchange its activations wait behind (sim/exchange.py), and the group dissolves when
the last lands; `off`, the restore happens at one step boundary: the group stops (the end of its
step in flight, or now if it is idle), every link copies at once, and the head's first step
alone starts when the slowest has landed (`GroupNetwork.hold`, sim/group.py); the members
serve alone from then too. The stall is `max_m copy_m`, copy_m = link(w_m + kv_m) from peers,
max(host(w_m), link(kv_m)) from the host. A member lost before they land: sim_faults.py (one
fault: the head recomputes and reloads from its host copy; no restore).
"""

from __future__ import annotations

import anyio
import attrs
import structlog

from engine.cluster.adoption import PoolTooSmall
from engine.cluster.drop_plan import GroupPlan
from engine.cluster.messages import GroupsChanged
from engine.messages import Regroup
from sim.exchange import SimExchange
from sim.network import NetworkLink

log = structlog.get_logger(actor="coordinator")


def restore_bytes(groups, g: GroupPlan, used: int) -> tuple[list[int], list[int]]:
    """(weights, KV) bytes each member of `g` gets back, in member order, for `used` blocks of
    the head's pool in use."""
    layers = groups.model.num_layers
    per_layer = groups.model.weight_bytes / layers
    weights, kv = [], []
    for m, r in zip(g.members, g.layers):
        weights.append(int(per_layer * (layers - len(r))))
        kv.append(int(used * groups.block_bytes * len(r) / layers) if m != g.head else 0)
    return weights, kv


def one_step_s(link: NetworkLink, host: NetworkLink | None, weights: list[int],
               kv: list[int]) -> float:
    """How long a one-step restore stops the group: the slowest member's copies (`host` None:
    its weights from peers, over its pipeline link with its KV)."""
    return max((link.send_s(w + k) if host is None else max(host.send_s(w), link.send_s(k))
                for w, k in zip(weights, kv)), default=0.0)


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
    head = groups.instances[g.head].engine
    pool = (await head.inspect()).scheduler
    used = pool.total_blocks - pool.free_blocks
    weights, kv = restore_bytes(groups, g, used)
    host = groups.host_link() if groups.restore_from == "host" else None
    net = head.backend.runner.network
    stall = 0.0
    if groups.restore_prefetch:
        await _while_serving(groups, net, weights, kv, host)
    if groups.groups.get(g.head) is not g:
        return  # a member was lost (meanwhile): sim_faults.py dissolves the group
    window = None
    if not groups.restore_prefetch:
        stall = one_step_s(groups.link, host, weights, kv)
        net.hold_to(max(anyio.current_time(), net.stepped_until) + stall, "restore")
        window = groups.one_step[g.head] = OneStep()
    solo = GroupPlan(group_id=-1, members=(g.head,), layers=(range(groups.model.num_layers),))
    try:
        await ask(head._scheduler_send, lambda r: Regroup(
            pool_blocks=groups.base_pools[g.head], group=solo, reply=r))
    except PoolTooSmall as exc:
        net.hold_to(0.0, "restore")  # nothing stopped: the restore is tried again next round
        if window is not None:
            groups.one_step.pop(g.head, None)
            window.decide(False)
        groups.counters.restore_retries += 1
        log.info("restore postponed", head=g.head, why=str(exc))
        await groups.coordinator.send(GroupsChanged())  # keep the restore trigger armed
        return
    if window is not None:  # the members' copies land with the head's
        window.decide(True)
        await net.held()  # (a member lost meanwhile moves it: its reload instead)
        if groups.one_step.get(g.head) is window:
            del groups.one_step[g.head]
        if groups.groups.get(g.head) is not g:
            return
    del groups.groups[g.head]
    await groups.coordinator.send(GroupsChanged(restored=g.head))
    c = groups.counters
    c.restores += 1
    copied = sum(weights) + sum(kv)
    c.events.append({"t": anyio.current_time(), "event": "restore", "members": list(g.members),
                     "copied_bytes": copied, "weight_bytes": sum(weights), "kv_bytes": sum(kv),
                     "used_blocks": used, "kept_layers": [len(r) for r in g.layers],
                     "prefetched": groups.restore_prefetch,
                     "source": groups.restore_from, "stall_s": stall,
                     "restore_s": anyio.current_time() - began})
    log.info("group restored", members=g.members, copied_bytes=copied)


async def _while_serving(groups, net, weights: list[int], kv: list[int],
                         host: NetworkLink | None) -> None:
    """The copies while the group serves: each member's over its pipeline link as an exchange
    (its weights too, from peers), the weights over its host link beside it (from the host)."""
    peer = [k + (w if host is None else 0) for w, k in zip(weights, kv)]
    net.exchanges = [SimExchange(groups.link, coordinated=groups.coordinated) for _ in peer]

    async def nothing(_: int) -> None:
        return None

    async with anyio.create_task_group() as tg:
        for x, nbytes in zip(net.exchanges, peer):
            tg.start_soon(x.run, [(-1, nbytes)], nothing)
        if host is not None:
            for w in weights:
                tg.start_soon(anyio.sleep, host.send_s(w))
