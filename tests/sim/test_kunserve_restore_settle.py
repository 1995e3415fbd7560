"""A simulated KunServe restore starts only once its group's formation exchange has settled, as
the torch head's does (shunter/cluster/instance_restore.py `_settled`): a restore asked for while
requests still wait for their KV waits for them (shunter/cluster/sim_formation.py `settled`),
and one that would wait over 10 s is refused as a pool too small is (counted in
`restore_retries`; the coordinator asks again later) and leaves the group as it was.

The formation's exchange is slowed here (a 20 MB/s link, 1 MiB chunks, for it alone) so that it
lasts 10-20 s; the restores are asked for directly, the policy having no restore trigger."""

from __future__ import annotations

import anyio
import trio
import trio.testing

import shunter
import shunter.cluster.sim_formation as sim_formation
from engine.config import EngineConfig
from policies import policy_path
from shunter.cluster.cluster import Cluster
from sim.exchange import SimExchange
from sim.network import NetworkLink

SLOW = NetworkLink(name="slow formation link", latency_s=0.0, bytes_per_s=20e6)


def _policy(tmp_path) -> str:
    path = tmp_path / "k.policy"
    path.write_text(f'policy k extends "{policy_path("kunserve_exchange")}" {{\n'
                    f'  memory {{ restore_prefetch on; restore_from peer }}\n}}\n')
    return str(path)


async def _run(policy: str, formed: anyio.Event):
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300, policy=policy)
    async with Cluster.start(config, instances=2, kind="inprocess") as cluster:
        ends, seen = [], {}

        async def one(i: int, prompt: int, max_tokens: int) -> None:
            await anyio.sleep(i * 0.005)
            done = await cluster.complete(list(range(1, prompt + 1)), shunter.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True))
            ends.append((done.finish_reason, len(done.token_ids), max_tokens))

        async def restores() -> None:
            await formed.wait()
            groups = cluster.groups
            (head,) = groups.groups
            seen["formation"] = formation = groups.exchanging[head]
            seen["pending_at_first"] = len(formation.pending)
            for attempt in ("first", "second"):
                seen[f"{attempt}_asked"] = anyio.current_time()
                groups.busy = True
                await groups._restore_all((head,))
                seen[f"{attempt}_done"] = anyio.current_time()
                seen[f"{attempt}_retries"] = groups.counters.restore_retries
                seen[f"{attempt}_pool"] = (await groups.instances[head].engine.inspect()
                                           ).scheduler.total_blocks

        with anyio.fail_after(600):  # virtual seconds
            async with anyio.create_task_group() as tg:
                tg.start_soon(restores)
                for i in range(40):
                    tg.start_soon(one, i, 399, 40)
                for i in range(2):
                    tg.start_soon(one, i, 399, 1500)
        after = await cluster.inspect()
        seen["settled_at"] = seen.pop("formation").settled_at
        return ends, seen, cluster.groups, after


def test_a_restore_waits_for_the_formation_exchange_or_is_refused(tmp_path, monkeypatch):
    formed = anyio.Event()
    exchange = sim_formation.exchange

    def slow(link, *, coordinated):
        return SimExchange(SLOW, coordinated=coordinated, chunk_bytes=2**20)

    def form(groups, g, waiting, sources):
        exchange(groups, g, waiting, sources)
        formed.set()

    monkeypatch.setattr(sim_formation, "SimExchange", slow)
    monkeypatch.setattr("shunter.cluster.groups.exchange", form)
    ends, seen, groups, after = trio.run(_run, _policy(tmp_path), formed,
                                         clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(set(ends)) == [("length", 40, 40), ("length", 1500, 1500)] and len(ends) == 42
    took = seen["settled_at"] - seen["first_asked"]
    assert seen["pending_at_first"] > 0 and 10.0 < took < 20.0, seen
    # the first restore waited its 10 s, was refused and left the group's pool as it was
    assert seen["first_retries"] == 1, seen
    assert seen["first_done"] - seen["first_asked"] >= 10.0 - 1e-6
    assert seen["first_pool"] == 600 + 32 * 209
    # the second waited for the rest of the exchange, then restored
    (event,) = [e for e in groups.counters.events if e["event"] == "restore"]
    began = event["t"] - event["restore_s"]
    assert began == seen["second_asked"]
    assert event["settle_s"] > 0 and began + event["settle_s"] >= seen["settled_at"] - 1e-9, event
    assert seen["second_retries"] == 1 and seen["second_pool"] == 300
    assert groups.counters.restores == 1 and not groups.groups
    assert all(s.allocator.allocated_blocks == 0 for s in after.snapshots)
