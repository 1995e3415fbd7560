"""The coordinator (actors/coordinator.py) stops dispatching to a plan's members as it plans
the drop, before any member hands its requests over: a request that reached a torch member
between its export and its serving the group ran there alone, and the member clears its own
sequences as it joins (gpu/group_member.py `serve_member`). The redirect is undone at the next
monitor round when no formed group holds the member (a plan refused, postponed or not acted
on), and at once when the front door reports the formation failed (`GroupsChanged(restored)`).
Shared by the simulator's front door (shunter/cluster/groups.py), whose member sweep stays as
the backstop. Stand-in monitor, no processes."""

from __future__ import annotations

import anyio
import pytest

from actors.coordinator import Coordinator
from engine.cluster.dispatch import DISPATCH_RULES, DispatchTable
from engine.cluster.drop_plan import GroupPlan
from engine.cluster.messages import ChooseInstance, CheckOverload, GroupsChanged
from engine.cluster.overload import Drop
from engine.reply import Reply

PAIR = GroupPlan(group_id=1, members=(0, 1), layers=(range(2), range(2, 4)))


class Monitor:
    """What the coordinator uses of `OverloadMonitor`: `decide` gives the next planned action."""

    def __init__(self, *actions) -> None:
        self.actions, self.groups = list(actions), {}

    def decide(self, stats, alive, now=None):
        return self.actions.pop(0) if self.actions else None

    def formed(self, g) -> None:
        self.groups[g.head] = g

    def restored(self, head) -> None:
        self.groups.pop(head, None)


async def _ask(coord, make):
    reply = Reply()
    coord.handle(make(reply))
    with anyio.fail_after(5):
        return await reply.wait()


async def _chosen(coord, n: int = 9) -> set[int]:
    return {await _ask(coord, lambda r: ChooseInstance(demand_tokens=8, reply=r))
            for _ in range(n)}


def _coordinator(*actions) -> Coordinator:
    send, inbox = anyio.create_memory_object_stream(1)
    send.close()
    return Coordinator(table=DispatchTable(3, 16), rule=DISPATCH_RULES["round_robin"],
                       inbox=inbox, overload=Monitor(*actions))


def _drop(*groups) -> Drop:
    return Drop(plan=None, new_groups=groups)


@pytest.mark.anyio
async def test_a_planned_member_is_not_chosen_from_the_plan_on(anyio_backend):
    coord = _coordinator(_drop(PAIR))
    assert await _chosen(coord) == {0, 1, 2}
    assert isinstance(await _ask(coord, lambda r: CheckOverload(reply=r)), Drop)
    assert await _chosen(coord) == {0, 2}, "a member of the planned group is still chosen"
    coord.handle(GroupsChanged(formed=PAIR))
    assert await _ask(coord, lambda r: CheckOverload(reply=r)) is None
    assert await _chosen(coord) == {0, 2}  # formed: redirected while it lasts
    coord.handle(GroupsChanged(restored=0))
    assert await _chosen(coord) == {0, 1, 2}


@pytest.mark.anyio
async def test_a_plan_not_formed_gives_its_members_back(anyio_backend):
    coord = _coordinator(_drop(PAIR), _drop(PAIR))
    await _ask(coord, lambda r: CheckOverload(reply=r))
    assert await _chosen(coord) == {0, 2}
    assert await _ask(coord, lambda r: CheckOverload(reply=r)) is not None  # planned again
    assert await _chosen(coord) == {0, 2}
    assert await _ask(coord, lambda r: CheckOverload(reply=r)) is None  # not acted on
    assert await _chosen(coord) == {0, 1, 2}, "a plan never formed keeps its member away"
    await _ask(coord, lambda r: CheckOverload(reply=r))
    coord.overload.actions.append(_drop(PAIR))
    await _ask(coord, lambda r: CheckOverload(reply=r))
    coord.handle(GroupsChanged(restored=0))  # the front door: 'form failed'
    assert await _chosen(coord) == {0, 1, 2}


@pytest.mark.anyio
async def test_a_member_of_a_running_group_keeps_its_redirect(anyio_backend):
    """A plan that grows the running pair with instance 2: 2 is redirected while it joins;
    refused, 2 comes back and 1 stays with its group."""
    three = GroupPlan(group_id=2, members=(0, 1, 2), layers=(range(2), range(2, 3), range(3, 4)))
    coord = _coordinator(None, _drop(three))
    coord.handle(GroupsChanged(formed=PAIR))
    await _ask(coord, lambda r: CheckOverload(reply=r))
    await _ask(coord, lambda r: CheckOverload(reply=r))
    assert await _chosen(coord) == {0}
    await _ask(coord, lambda r: CheckOverload(reply=r))  # the growth refused
    assert await _chosen(coord) == {0, 2}
    coord.handle(GroupsChanged(restored=0))
    assert await _chosen(coord) == {0, 1, 2}
