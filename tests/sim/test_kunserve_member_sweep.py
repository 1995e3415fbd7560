"""A request the coordinator dispatches to an instance while a group that takes it as a member
is forming (after the member handed its requests over, before the redirect) does not stay on
the member, served alone by an engine whose layers are dropped (kun-bench, s32: on long
contexts at 0.2x one ran there for 35 s): the next monitor round moves it to the head, which
prefills it again (shunter/cluster/groups.py `SimGroups._sweep_members`; noted in the report's
`swept`).

Requests arrive all along (every 5 ms for 1.5 s). Since s32 the coordinator stops choosing a
planned group's members at the round that plans it (actors/coordinator.py `_forming`), so none
lands on a forming member and none is swept; with that redirect taken out (the sweep's own
test: it stays the backstop for a request whose instance was chosen before the plan) some land
on the member, which has none in flight once it exported them, in the formation's window."""

from __future__ import annotations

import anyio
import pytest
import trio
import trio.testing

from actors import coordinator
from engine.cluster.overload import OverloadMonitor
from engine.config import EngineConfig
from policies import policy_path
from shunter.cluster.cluster import Cluster
from tests.sim.kunserve_burst import ends_of, start_burst

N = 300


async def _stream(rounds: list):
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300,
                          policy=policy_path("kunserve_exchange"))
    async with Cluster.start(config, instances=2, kind="inprocess") as cluster:
        done = []
        with anyio.fail_after(300):  # virtual seconds
            async with anyio.create_task_group() as tg:
                start_burst(tg, cluster, done, N, max_tokens=60)
        return ends_of(done), cluster.groups


@pytest.mark.parametrize("redirect", [True, False], ids=["redirect", "sweep-only"])
def test_a_request_sent_to_a_forming_member_moves_to_the_head(monkeypatch, redirect):
    rounds: list = []
    decide = OverloadMonitor.decide

    def watched(self, stats, alive, **kw):
        members = [i for i, s in enumerate(stats) if s is not None
                   and self.member_of(i) is not None]
        rounds.append({i: stats[i].running + stats[i].waiting for i in members})
        return decide(self, stats, alive, **kw)

    monkeypatch.setattr(OverloadMonitor, "decide", watched)
    if not redirect:  # the coordinator no longer sees a plan as a Drop: no redirect at the plan
        monkeypatch.setattr(coordinator, "Drop", type("NotADrop", (), {}))
    ends, groups = trio.run(_stream, rounds, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(set(ends)) == [("length", 60)] and len(ends) == N
    assert groups.counters.groups_formed >= 1
    held = [k for k, r in enumerate(rounds) if any(r.values())]
    swept = groups.swept
    assert groups.report(0.0)["swept"] == swept
    assert {e["event"] for e in groups.counters.events} <= {"group", "restore", "fault"}
    if redirect:  # no request reaches a forming member, so none waits there and none is swept
        assert not held, [rounds[k] for k in held]
        assert not swept, swept
        return
    # the window was hit, and a member holds requests in one round at most each time
    assert held
    assert not [k for k in held if k + 1 in held], [rounds[k] for k in held]
    assert swept and sum(e["requests"] for e in swept) >= len(held), swept
