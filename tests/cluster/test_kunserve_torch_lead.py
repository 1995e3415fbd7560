"""A torch instance whose runner cannot lead KunServe groups (no `form`: a plain TorchRunner)
named as a group's head. The front door learns each instance's answer once it joined the data
plane and refuses such a plan before any member hands a request over; an instance that gets
`HeadGroup` anyway (a front door that did not ask) takes the requests handed over and
recomputes them, lets the members go, and answers the error, instead of raising before taking
them over (which left them adopted by nobody). Stand-ins for the instances, the engine and
the link; the process-level paths of a group that is not formed:
test_kunserve_torch_faults.py."""

from __future__ import annotations

import anyio
import pytest


def _one_event_loop(anyio_backend) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("the stand-ins do not depend on the event loop")


@pytest.mark.anyio
async def test_the_front_door_refuses_a_head_that_cannot_lead_before_any_export(anyio_backend):
    from engine.cluster.drop_plan import GroupPlan
    from shunter.cluster.group_wire import AskGroupStats, FreePort, GroupAnswer
    from shunter.cluster.remote_groups import GroupCommandError, RemoteGroups

    _one_event_loop(anyio_backend)
    asked = []

    class Instance:
        def __init__(self, index):
            self.index, self.alive, self._live, self.moved_to = index, True, {}, {}

        async def _ask(self, make):
            msg = make(0)
            asked.append((self.index, type(msg).__name__))
            value = {"can_lead": self.index != 0} if isinstance(msg, AskGroupStats) else (
                1234 if isinstance(msg, FreePort) else None)
            return GroupAnswer(key=0, value=value)

    groups = RemoteGroups([Instance(i) for i in range(2)], coordinator=None,
                          base_pools=[24] * 2, num_layers=4)
    await groups.join()
    assert groups.leads == [False, True]
    asked.clear()
    with pytest.raises(GroupCommandError, match=r"instance 0: its runner cannot lead KunServe "
                                                r"pipeline groups .*nothing moved"):
        await groups.form(GroupPlan(group_id=2, members=(0, 1), layers=(range(2), range(2, 4))))
    assert asked == [] and not groups.groups  # no member was asked to export


@pytest.mark.anyio
@pytest.mark.parametrize("given_up", [False, True])
async def test_a_head_that_cannot_lead_recomputes_what_was_handed_over(anyio_backend,
                                                                       monkeypatch, given_up):
    """Also when the front door had given the group up (member 2 could not join after member 1
    exported): then only member 1 waits for the start and is let go (a `GroupAbandon` sent to
    member 2, which waits for nothing, would be read as the end of its next group)."""
    import attrs

    import gpu.group_runner
    from engine.cluster.drop_plan import GroupPlan
    from engine.messages import Regroup, TakeOverStreams
    from engine.params import SamplingParams
    from engine.request import Request
    from shunter.cluster.group_wire import HeadGroup, Moved
    from shunter.cluster.instance_groups import GroupNotFormed, InstanceGroups

    _one_event_loop(anyio_backend)
    abandoned = []
    monkeypatch.setattr(gpu.group_runner, "abandon_members",
                        lambda ranks, *, lost, why: abandoned.append((tuple(ranks), why)))

    class Thread:
        async def run(self, fn, *args):
            return fn(*args)

    class Runner:  # a TorchRunner's: no `form`
        _thread = Thread()

    class Server:
        def relay(self, key, request_id, recv):
            pass

        async def cancel_if_asked(self, key, request_id):
            pass

    to_frontend, frontend = anyio.create_memory_object_stream(8)
    to_scheduler, scheduler = anyio.create_memory_object_stream(8)
    engine = attrs.make_class("E", ["backend", "_frontend_send", "_scheduler_send"])(
        attrs.make_class("B", ["runner", "codec"])(Runner(), None), to_frontend, to_scheduler)
    req = Request(id=3, request_class="default", priority=0, tenant="default",
                  conversation_id=None, turn=1, arrival=0.0, ttft_ms=None, tpot_ms=None,
                  prompt_ids=[5] * 6, sampling=SamplingParams(max_tokens=16),
                  stop_ids=frozenset(), eos_token_ids=(), state="running", computed_tokens=8,
                  blocks=2, output_ids=[7, 8, 9])
    plan = GroupPlan(group_id=5, members=(0, 1, 2), layers=(range(1), range(1, 2),
                                                           range(2, 4)))
    msg = HeadGroup(key=1, plan=plan, adopted=((1, Moved(cluster_key=41, request=req,
                                                          stream={})),),
                    not_formed="instance 2 could not join" if given_up else None,
                    exported=(1,) if given_up else ())
    regroups = []

    async def engine_side() -> None:
        take = await frontend.receive()
        assert isinstance(take, TakeOverStreams)
        take.reply.send({3: 17})
        regroup = await scheduler.receive()
        regroups.append(regroup)
        regroup.reply.send(())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine_side)
            head = InstanceGroups(engine, Server())._head(msg, tg)
            if given_up:
                assert await head == {"adopted": 1, "formed": False}
            else:
                with pytest.raises(GroupNotFormed, match=r"group \(0, 1, 2\) not formed "
                                   r"\(instance 0's runner cannot lead KunServe pipeline "
                                   r"groups\); the 1 requests handed over are recomputed at "
                                   r"instance 0"):
                    await head
    (regroup,) = regroups
    assert isinstance(regroup, Regroup) and regroup.adopt_recompute, regroup
    assert [q.id for q in regroup.adopt] == [17] and req.output_ids == [7, 8, 9]
    assert abandoned == ([((1,), "instance 2 could not join")] if given_up else [
        ((1, 2), "instance 0's runner cannot lead KunServe pipeline groups")])
