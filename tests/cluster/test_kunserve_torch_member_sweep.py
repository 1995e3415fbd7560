"""The torch front door sweeps a group member's requests to its head (shunter/cluster/
remote_queues.py `sweep_members`, from `RemoteGroups.act` each monitor round): a request
dispatched to a member after it handed its requests over and before `GroupsChanged(formed)`
redirected its new ones (the review of session 32, after kun-bench's find on the simulator)
would otherwise wait on the member, queued behind the group on its device thread, for the
group's whole life. Stand-ins for the instances, no processes. Plant (no sweep): the member is
never asked, 'assert [] == ['ExportQueued']'."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.mark.anyio
async def test_requests_waiting_on_a_group_member_move_to_its_head(anyio_backend):
    from engine.cluster.drop_plan import GroupPlan
    from shunter.cluster.group_wire import AdoptQueued, ExportQueued, GroupAnswer, Moved
    from shunter.cluster.remote_groups import RemoteGroups

    if anyio_backend != "asyncio":
        pytest.skip("the stand-ins do not depend on the event loop")

    class Instance:
        def __init__(self, index, queued=()):
            self.index, self.alive, self.moved_to = index, True, {}
            self._live = {k: f"relay {k}" for k in queued}
            self.queued, self.asked = list(queued), []

        async def _ask(self, make):
            msg = make(0)
            self.asked.append(type(msg).__name__)
            if isinstance(msg, ExportQueued):
                out = tuple(Moved(cluster_key=k, request=None, stream={}) for k in self.queued)
                self.queued = []
                return GroupAnswer(key=0, value=out)
            assert isinstance(msg, AdoptQueued), msg
            return GroupAnswer(key=0, value=len(msg.moved))

    def stats(waiting):
        return [SimpleNamespace(waiting=w, running=0, queued_tokens=8 * w, free_blocks=100)
                for w in waiting]

    head, member, alone = Instance(0), Instance(1, queued=(41, 42)), Instance(2)
    groups = RemoteGroups([head, member, alone], coordinator=None, base_pools=[24] * 3,
                          num_layers=4)
    groups.groups[0] = GroupPlan(group_id=1, members=(0, 1), layers=(range(2), range(2, 4)))
    await groups.act(None, stats([0, 0, 0]))  # nothing waits on the member: nothing asked
    assert member.asked == [] == head.asked
    await groups.act(None, stats([0, 2, 0]))
    assert member.asked == ["ExportQueued"], member.asked
    assert head.asked == ["AdoptQueued"] and alone.asked == []
    assert sorted(head._live) == [41, 42] and member._live == {}
    assert all(member.moved_to[k] is head for k in (41, 42))  # (their cancels go there)
    swept = [e for e in groups.counters.events if e["event"] == "swept"]
    assert [(e["from"], e["to"], e["requests"]) for e in swept] == [(1, 0, 2)]
    groups.busy = True  # a restore under way: no sweep
    member.queued, member._live = [43], {43: "relay 43"}
    await groups.act(None, stats([0, 1, 0]))
    assert member.asked == ["ExportQueued"]
