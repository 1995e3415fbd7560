"""An instance lost while it serves in a KunServe group, on the simulator (§4.4, fault
tolerance): "we dynamically restore these affected instances to ensure normal execution under
failures. By replicating parameters in host DRAM or SSDs, we can always ensure successful
parameter restoration."

What happens (shunter/cluster/groups.py calls `recover` from the monitor's round once it sees
a member of a group marked down):
- the group is dissolved at once: no new group step may use the lost stage;
- every surviving member reloads the layers it had dropped from its host copy (timed on the
  host link: the profile's copy link), and serves alone afterwards;
- a lost member took the KV of its layers with it: the head's requests that held KV are
  preempted by recompute (their tokens kept, prefilled again once the head serves alone; the
  client sees a pause, not an error). The head's pool shrinks back to its own at once (nothing
  is held after the recompute) and its pipeline waits behind the reload: no step runs until
  its layers are back;
- a member lost while a one-step restore's copies are under way (`restore_prefetch off`,
  sim_restore.py), the head told to serve alone already: the same, without a second switch;
  the head's first step alone waits for its layers from its host copy from the loss (not for
  the copies, which never land), and the restore is not counted (`_solo_already`);
- a lost head took the group's requests (the head's engine held them all): each ends with the
  head engine's error, and the members, which hold none, reload and serve alone.
New requests for the group's members go to its head until the reload is done, then to each
member again (the coordinator's `GroupsChanged(restored=head)`).
"""

from __future__ import annotations

import anyio

from engine.cluster.drop_plan import GroupPlan
from engine.cluster.messages import GroupsChanged
from engine.messages import Regroup
from shunter.cluster.sim_restore import restore_bytes
from sim.exchange import SimExchange
from sim.network import NetworkLink


async def recover(groups, g: GroupPlan, lost: list[int], ask) -> None:
    """Dissolve `g` after `lost` members went down (see the module docstring). `groups` is
    the cluster's `SimGroups`, which no longer lists `g`; `ask(send, make)` sends a message
    made with a reply and waits for the answer."""
    survivors = [m for m in g.members if m not in lost]
    weights, _ = restore_bytes(groups, g, 0)
    reload = {m: w for m, w in zip(g.members, weights) if m in survivors}
    host = groups.host_link()
    recomputed = ()
    began = anyio.current_time()
    window = groups.one_step.pop(g.head, None)
    if window is not None:  # a one-step restore's copies were under way: was it switched yet?
        await window.decided.wait()
    head = groups.instances[g.head].engine
    if g.head in survivors and window is not None and window.solo:
        recomputed = await _solo_already(groups, g.head, reload[g.head], host, ask)
    elif g.head in survivors:
        stall = SimExchange(host, coordinated=False)  # the pipeline waits for its layers
        head.backend.runner.network.exchanges.append(stall)
        recomputed = await ask(head._scheduler_send, lambda r: Regroup(
            recompute=True, pool_blocks=groups.base_pools[g.head], reply=r))

        async def nothing(_: int) -> None:
            return None

        await stall.run([(-1, reload[g.head])], nothing)
        solo = GroupPlan(group_id=-1, members=(g.head,), layers=(range(groups.model.num_layers),))
        await ask(head._scheduler_send, lambda r: Regroup(group=solo, reply=r))
    else:
        await anyio.sleep(max((host.send_s(b) for b in reload.values()), default=0.0))
    groups.reloading.difference_update(g.members)
    await groups.coordinator.send(GroupsChanged(restored=g.head))
    c = groups.counters
    c.faults += 1
    c.recomputed_requests += len(recomputed)
    c.events.append({"t": anyio.current_time(), "event": "fault", "members": list(g.members),
                     "lost": lost, "recomputed": len(recomputed),
                     "in_restore": window is not None and window.solo,
                     "reload_s": anyio.current_time() - began})


async def _solo_already(groups, index: int, weight_bytes: int, host: NetworkLink,
                        ask) -> tuple:
    """A member lost while a one-step restore's copies were under way, after the head's switch
    to serving alone: what it was to receive from the lost member never lands (the torch head's
    restore step fails the same way, gpu/restore_kv.py). Its requests are recomputed, as for any
    loss while grouped, and its first step alone waits for its dropped layers from its host copy
    from now instead of for the copies (`GroupNetwork.hold_to`); it is solo already."""
    head = groups.instances[index].engine
    net = head.backend.runner.network
    until = anyio.current_time() + host.send_s(weight_bytes)
    net.hold_to(until, "fault")
    recomputed = await ask(head._scheduler_send, lambda r: Regroup(
        recompute=True, pool_blocks=groups.base_pools[index], reply=r))
    await anyio.sleep(max(0.0, until - anyio.current_time()))
    return recomputed
