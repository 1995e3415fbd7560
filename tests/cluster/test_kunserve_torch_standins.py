"""KunServe's torch group managers with stand-ins for the instances and the runner (no
processes): the front door's `form` giving up when a later member cannot join, the head's
arrivals task finding a member lost, and a member that started when a later member's start
failed. The process-level paths: test_kunserve_torch_faults.py. Planted bugs checked by hand
(/work/notes/issue16_torch_round4.md, issue16_torch_round5.md): `form` not giving up fails the
first; an arrivals' step that does not catch the loss fails the second; the head's `open` not
telling the started member, or a member's abandon not restoring its layers, fails the third."""

from __future__ import annotations

import anyio
import attrs
import pytest

SOLO_BLOCKS = 24


def _one_event_loop(anyio_backend) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("the stand-ins do not depend on the event loop")


@pytest.mark.anyio
async def test_form_gives_up_when_a_later_member_cannot_join(anyio_backend):
    """Stand-ins for the instances: in a plan of three, member 1 hands its request over and
    member 2's export fails (its instance went away): `form` raises, but first sends the head
    `HeadGroup(not_formed=..., exported=(1,))` with member 1's request (none is left
    unadopted)."""
    from engine.cluster.drop_plan import GroupPlan
    from engine.errors import EngineDeadError
    from shunter.cluster.group_wire import ExportGroup, GroupAnswer, HeadGroup, Moved
    from shunter.cluster.remote_groups import RemoteGroups

    _one_event_loop(anyio_backend)
    asked = []

    class Instance:
        def __init__(self, index):
            self.index, self.alive, self._live, self.moved_to = index, True, {}, {}

        async def _ask(self, make):
            msg = make(0)
            asked.append((self.index, msg))
            if isinstance(msg, ExportGroup) and self.index == 2:
                raise EngineDeadError("instance 2 went away")
            if isinstance(msg, ExportGroup):
                return GroupAnswer(key=0, value=(Moved(cluster_key=41, request=None,
                                                       stream={}),))
            return GroupAnswer(key=0, value={})

    instances = [Instance(i) for i in range(3)]
    instances[1]._live[41] = "relay"
    groups = RemoteGroups(instances, coordinator=None, base_pools=[24] * 3, num_layers=4)
    plan = GroupPlan(group_id=3, members=(0, 1, 2), layers=(range(1), range(1, 2),
                                                           range(2, 4)))
    with pytest.raises(EngineDeadError):
        await groups.form(plan)
    head = [m for i, m in asked if i == 0]
    assert len(head) == 1 and isinstance(head[0], HeadGroup), asked
    assert head[0].exported == (1,) and "instance 2 could not join" in head[0].not_formed
    assert [(k, mv.cluster_key) for k, mv in head[0].adopted] == [(1, 41)]
    assert instances[0]._live == {41: "relay"} and instances[1].moved_to == {41: instances[0]}
    assert not groups.groups


@pytest.mark.anyio
async def test_a_member_lost_found_by_the_arrivals_poll_recomputes_instead_of_crashing(
        anyio_backend):
    """While requests wait for their KV and no step runs, the head's arrivals task asks the
    members with an empty step (`GroupRunner.poll`); when that step finds a member lost, the
    runner recovers (`lose_group`: its layers from its host copy, every request's KV gone) and
    the scheduler is told to recompute every request, its pool its own and the runner solo
    again (`Regroup(recompute, pool_blocks, group=plan of one)`), instead of the exception
    ending the instance's task group (and with it every request there). Stand-ins for the
    runner and the scheduler: the process-level paths are the tests above."""
    from engine.messages import Regroup
    from gpu.data_plane import GroupMemberLost
    from shunter.cluster.instance_groups import InstanceGroups

    _one_event_loop(anyio_backend)

    class Group:
        ranks = (3, 5)

        def poll(self, step_id):
            raise GroupMemberLost(5, f"step {step_id} was sent", RuntimeError("reset by peer"))

        def arrived(self):
            return []

    class Thread:
        async def run(self, fn, *args):
            return fn(*args)

    class Runner:
        num_blocks = SOLO_BLOCKS
        _thread = Thread()
        _model_config = attrs.make_class("M", {"num_layers": attrs.field(default=4)})()
        lost_with = None

        def lose_group(self, exc):
            self.group, self.lost_with = None, exc

    runner = Runner()
    runner.group = Group()
    send, recv = anyio.create_memory_object_stream(8)
    engine = attrs.make_class("E", ["backend", "_scheduler_send"])(
        attrs.make_class("B", ["runner"])(runner), send)
    groups = InstanceGroups(engine, server=None)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(groups._arrivals, {7})
            msg = await recv.receive()
            msg.reply.send(())
    assert isinstance(msg, Regroup) and msg.recompute and msg.pool_blocks == SOLO_BLOCKS, msg
    assert msg.group.members == (3,) and msg.group.layers == (range(4),), msg.group
    assert runner.group is None and "instance 5 was lost while step 0" in str(runner.lost_with)


@pytest.mark.parametrize("fails", ["GroupStart", "GroupGo"])
def test_a_later_members_start_failing_leaves_the_earlier_member_serving_alone(
        monkeypatch, kunserve_model, fails):
    """A group of three, member 2 unreachable. The head sends every member its `GroupStart`,
    then, once all got theirs, `GroupGo` (only then does a member drop layers and exchange KV).
    `GroupStart` to member 2 fails: member 1 gets `GroupAbandon` in place of `GroupGo` and
    serves alone having dropped nothing and queued no exchange (before `GroupGo`, it had
    started: its KV chunks for the head sat in gloo, never taken). `GroupGo` to member 2 fails
    (it died after its start): member 1 had started, and restores its dropped layers from its
    host copy in its serving loop. Either way the head drops nothing and leads no group, and
    member 1 keeps no sequence. The head is a real runner on the tiny model, member 1 the real
    `serve_member` reading what the head sent; the data plane and member 1's stage are
    stand-ins (three processes: the fault tests' cost three times over)."""
    import types

    import gpu.group_member as gm
    import gpu.group_runner as gr
    from engine.cluster.drop_plan import GroupPlan
    from engine.config import EngineConfig
    from gpu.data_plane import GroupMemberLost
    from shunter.backends import build_backend

    to_member, sent = [], []

    def send(obj, dst, tag, what):
        sent.append((type(obj).__name__, dst))
        if dst == 2 and type(obj).__name__ == fails:
            raise GroupMemberLost(2, what, RuntimeError("Connection closed by peer"))
        if dst == 1:
            to_member.append(obj)

    class Plane:  # the data plane, and the stage's channel of the group (what it closes)
        def __init__(self, rank):
            self.rank, self.closed = rank, []

        def close(self, *, broken=False):
            self.closed.append(broken)

    class Stage:  # member 1's: built once it may start (its layers dropped, KV queued)
        prefetch = kv_prefetch = prefetch_failed = None  # (GroupStage's: no restore prefetch)

        def __init__(self, model, plane, start, me, seqs):
            self.model, self.me, self.seqs, self.plane = model, me, dict(seqs), plane
            built.append(me)

    head_plane, member_plane, restored, built = Plane(0), Plane(1), [], []
    monkeypatch.setattr(gr, "send_obj", send)
    monkeypatch.setattr(gr, "data_plane", lambda: head_plane)
    runner = build_backend(EngineConfig(model=kunserve_model, device="cpu", threads=1,
                                        num_blocks=SOLO_BLOCKS, block_size=4,
                                        cpu_swap_blocks=0)).runner
    try:
        runner._load()
        plan = GroupPlan(group_id=4, members=(0, 1, 2), layers=(range(1), range(1, 2),
                                                               range(2, 4)))
        with pytest.raises(GroupMemberLost, match="instance 2 was lost"):
            runner.form(plan, ())
        go = [("GroupGo", 1), ("GroupGo", 2)] if fails == "GroupGo" else []
        assert sent == [("GroupStart", 1), ("GroupStart", 2), *go, ("GroupAbandon", 1)], sent
        assert runner.group is None and getattr(runner._model, "drop_state", None) is None
    finally:
        runner.close()

    monkeypatch.setattr(gm, "data_plane", lambda: member_plane)
    monkeypatch.setattr(gm, "recv_obj", lambda src, tag, what: to_member.pop(0))
    monkeypatch.setattr(gm, "GroupStage", Stage)
    monkeypatch.setattr(gm, "restore_layers", restored.append)
    solo = types.SimpleNamespace(_model="member 1's model", _seqs={9: "its request's KV"})
    out = gm.serve_member(solo, 0)
    assert "instance 2 was lost while the group was being formed" in out["abandoned"], out
    assert solo._seqs == {} and not to_member
    if fails == "GroupStart":
        assert out["formed"] is False and built == [] and restored == [], out
    else:
        assert built == [1] and restored == ["member 1's model"] and member_plane.closed == [True]


@pytest.mark.anyio
async def test_a_restore_answered_after_its_group_was_lost_ends_quietly(anyio_backend):
    """The head answers `LeaveGroup` with success while the front door's monitor round (`act`)
    has already ended the group because a member went away: `restore` leaves the group ended
    as lost (one 'lost' event, no 'restore') instead of failing on the group it no longer
    holds (it raised KeyError: 0 when it deleted it again)."""
    from engine.cluster.drop_plan import GroupPlan
    from shunter.cluster.group_wire import GroupAnswer, LeaveGroup
    from shunter.cluster.remote_groups import RemoteGroups

    _one_event_loop(anyio_backend)
    sent = []

    class Coordinator:
        async def send(self, msg):
            sent.append(msg)

    class Instance:
        def __init__(self, index):
            self.index, self.alive, self._live, self.moved_to = index, True, {}, {}

        async def _ask(self, make):
            msg = make(0)
            assert isinstance(msg, LeaveGroup), msg
            instances[1].alive = False  # the member went away while the head left the group
            await groups.act(None, None)
            return GroupAnswer(key=0, value={"restore_s": 0.1})

    instances = [Instance(i) for i in range(2)]
    groups = RemoteGroups(instances, coordinator=Coordinator(), base_pools=[24] * 2,
                          num_layers=4)
    groups.groups[0] = GroupPlan(group_id=1, members=(0, 1), layers=(range(2), range(2, 4)))
    assert await groups.restore(0)
    assert not groups.groups and groups.counters.restores == 0
    assert [e["event"] for e in groups.counters.events] == ["lost"]
    assert [m.restored for m in sent] == [0]
