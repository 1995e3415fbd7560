"""A group member lost while a restore's copies are under way (shunter/cluster/sim_restore.py
and sim_faults.py, §4.4).

One step (`restore_prefetch off`): the head has been told to serve alone and its first step
alone waits for the copies; what the lost member was to send never lands. As for any loss
while grouped, and as the torch head's restore step fails (gpu/restore_kv.py): its requests are
recomputed, once each, and it serves alone once its dropped layers are back from its host copy,
counted from the loss, not when the copies would have landed; the restore is not counted, the
fault is, once. (A loss seen before the switch took, the head's last grouped step still in
flight, goes the same way once `OneStep.decided`; no test times a loss into that step.)

Prefetched (the default): the head's pool shrank back first; the loss ends the copies at once.
"""

from __future__ import annotations

import anyio
import trio
import trio.testing

import shunter
from engine.config import EngineConfig
from policies import policy_path
from shunter.cluster.cluster import Cluster
from tests.sim.test_kunserve_restore_modes import _layer_bytes


async def _lose_in_the_window(policy: str):
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300, policy=policy)
    async with Cluster.start(config, instances=2, kind="inprocess") as cluster:
        ends, long, seen = [], [], {}

        async def one(i: int, max_tokens: int, out: list) -> None:
            await anyio.sleep(i * 0.005)
            done = await cluster.complete(list(range(1, 400)), shunter.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True))
            out.append((done.finish_reason, len(done.token_ids), done.timeline))

        with anyio.fail_after(300):  # virtual seconds: a request left without an end hangs
            async with anyio.create_task_group() as tg:
                for i in range(40):
                    tg.start_soon(one, i, 200, ends)
                for i in range(2):  # across the restore (4 calm seconds after the burst)
                    tg.start_soon(one, i, 1500, long)
                while not cluster.groups.groups:
                    await anyio.sleep(0.01)
                (head, g), = cluster.groups.groups.items()
                runner = cluster.instances[head].engine.backend.runner
                # the window: the copies are timed (hold_until ahead) and the head has switched
                # (its runner alone, held for them: about 1 s)
                while not (runner.network.hold_until > anyio.current_time()
                           and runner.group is None):
                    await anyio.sleep(0.01)
                seen.update(t=anyio.current_time(), stale=runner.network.hold_until,
                            stepped=runner.network.stepped_until,
                            live=(await cluster.instances[head].engine.inspect()
                                  ).scheduler.live_requests)
                await cluster.instances[g.members[1]].engine._scheduler_send.send("not a message")
            snap = await cluster.wait_idle()
            after = await cluster.complete(list(range(1, 9)), shunter.SamplingParams(
                max_tokens=4, ignore_eos=True))
        return ends, long, seen, snap, after, cluster, head, g


def test_a_member_lost_before_a_one_step_restore_lands_is_one_fault(tmp_path):
    policy = tmp_path / "off.policy"
    policy.write_text(f'policy k extends "{policy_path("kunserve")}" {{\n'
                      f'  memory {{ restore_prefetch off; restore_from peer }}\n}}\n')
    ends, long, seen, snap, after, cluster, head, g = trio.run(
        _lose_in_the_window, str(policy),
        clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted({(r, k) for r, k, _ in ends}) == [("length", 200)] and len(ends) == 40
    assert sorted((r, k) for r, k, _ in long) == [("length", 1500)] * 2
    groups = cluster.groups
    c = groups.counters
    assert (c.groups_formed, c.restores, c.faults) == (1, 0, 1)
    (fault,) = [e for e in c.events if e["event"] == "fault"]
    assert fault["lost"] == [g.members[1]]
    # every request live at the loss recomputed once (the lost member's KV never landed)
    assert len(seen["live"]) == 2 and fault["recomputed"] == c.recomputed_requests == 2
    # the head serves alone once its own dropped layers are back from the host, counted from
    # the loss (seen by the monitor's next round), not when the copies would have landed
    layers = groups.model.num_layers
    reload_s = groups.host_link().send_s(
        _layer_bytes(groups.model, groups.block_bytes) * (layers - len(g.layers[0])))
    assert seen["stale"] - seen["t"] > reload_s + 0.3  # the window is wide enough to tell
    assert reload_s <= fault["reload_s"] < reload_s + 0.1
    assert fault["t"] < seen["stale"]
    for _, _, t in long:  # (the last grouped step's token, when it was in flight, came before)
        first = next(x for x in t.token_times if x > max(seen["t"], seen["stepped"]) + 1e-6)
        assert seen["t"] + reload_s <= first < seen["stale"]
    assert fault["in_restore"]
    net = groups.instances[head].engine.backend.runner.network
    assert net.restore_stalls == [] and len(net.fault_holds) == 1
    assert net.fault_holds[0] <= reload_s + 0.1
    s = snap.snapshots[head]
    assert s.scheduler.total_blocks == 300 and s.allocator.allocated_blocks == 0
    assert not cluster.table.redirect and after.finish_reason == "length"


async def _lose_while_prefetching(policy: str):
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300, policy=policy)
    async with Cluster.start(config, instances=2, kind="inprocess") as cluster:
        ends, seen = [], {}

        async def one(i: int, max_tokens: int) -> None:
            await anyio.sleep(i * 0.005)
            done = await cluster.complete(list(range(1, 400)), shunter.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True))
            ends.append((done.finish_reason, len(done.token_ids)))

        with anyio.fail_after(300):
            async with anyio.create_task_group() as tg:
                for i in range(42):
                    tg.start_soon(one, i, 200 if i < 40 else 1500)
                while not cluster.groups.groups:
                    await anyio.sleep(0.01)
                (head, g), = cluster.groups.groups.items()
                net = cluster.instances[head].engine.backend.runner.network
                while net.named is None:  # the restore's copies run while the group serves
                    await anyio.sleep(0.01)
                sched = (await cluster.instances[head].engine.inspect()).scheduler
                seen.update(t=anyio.current_time(), live=sched.live_requests,
                            pool=sched.total_blocks)
                await cluster.instances[g.members[1]].engine._scheduler_send.send("not a message")
                while cluster.groups.busy:
                    await anyio.sleep(0.01)
                seen["free"] = anyio.current_time()
            await cluster.wait_idle()
        return ends, seen, cluster.groups, net


def test_a_member_lost_while_a_restore_prefetches_ends_the_prefetch(tmp_path):
    """The default restore (prefetch on, from peers), its head's pool shrunk back first: a
    member lost while the copies run while the group serves ends them (as the torch prefetch's threads stop): the group's fault
    is handled once (recompute, host reload) and the restore lets go at once, not when copies
    from a lost member would have landed."""
    ends, seen, groups, net = trio.run(
        _lose_while_prefetching, policy_path("kunserve"),
        clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(ends) == [("length", 200)] * 40 + [("length", 1500)] * 2
    c = groups.counters
    assert (c.restores, c.faults) == (0, 1)
    (fault,) = [e for e in c.events if e["event"] == "fault"]
    assert not fault["in_restore"] and fault["recomputed"] == len(seen["live"]) == 2
    assert seen["pool"] == 300  # as on torch, the head's pool shrank back before the copies
    assert seen["free"] - seen["t"] < 0.2  # the monitor's next round, not ~1 s of copies
    assert net.named is None and net.on_fill is None and not groups.prefetching
