"""Two running KunServe groups merge (shunter/cluster/remote_grow.py `merge`), checked with a
stand-in front door (no processes): the order of the commands on both paths, what a refusal
leaves; the processes' side is test_kunserve_torch_grow_merge.py."""

from __future__ import annotations

import pytest

from engine.cluster.drop_plan import GroupPlan
from engine.cluster.plan import stage_layers

LAYERS = 8


@pytest.mark.anyio
async def test_a_merge_restores_the_joining_group_before_its_instances_join(monkeypatch):
    """`merge` (stand-in front door): the head's check first, then the joining group restores,
    and its instances are asked to hand their requests over only once its head's runner is
    alone (its next step restores: `leading` goes False); a restore that does not fit yet
    postpones the merge with nothing moved; a head that never restores fails it by name."""
    import types

    import shunter.cluster.remote_grow as rg
    from engine.cluster.counters import ClusterCounters
    from shunter.cluster.group_wire import GrowGroup
    from shunter.cluster.remote_groups import GroupCommandError

    stays = GroupPlan(group_id=1, members=(0, 1), layers=stage_layers(LAYERS, 2))
    joins = GroupPlan(group_id=2, members=(2, 3), layers=stage_layers(LAYERS, 2))
    plan = GroupPlan(group_id=3, members=(0, 1, 2, 3), layers=stage_layers(LAYERS, 4))

    class Groups:
        num_layers = LAYERS

        def __init__(self, fits=True, steps_to_restore=3):
            self.calls, self.fits, self.leading = [], fits, None
            self.steps = steps_to_restore
            self.groups, self.counters = {0: stays, 2: joins}, ClusterCounters()
            self.coordinator = types.SimpleNamespace(send=self._sent)
            self.instances = [types.SimpleNamespace(alive=True, failure=None)] * 4

        async def _sent(self, msg):
            pass

        async def _command(self, head, make):
            msg = make(0)
            self.calls.append(("check" if isinstance(msg, GrowGroup) and msg.check
                               else type(msg).__name__, head))
            return {"pool_blocks": 9}

        async def restore(self, head):
            self.calls.append(("restore", head))
            if self.fits:
                self.leading = self.steps
            return self.fits

        async def stats(self, head):
            if self.leading:  # each look: one more step ran; the restore comes with one
                self.leading -= 1
            return {"head": {"leading": bool(self.leading)}}

        async def _export(self, head, m):
            self.calls.append(("export", m, bool(self.leading)))
            return ()

        async def note_kv(self, head):
            pass

    g = Groups()
    assert (await rg.merge(g, stays, joins, plan, direct=False)).members == (0, 1, 2, 3)
    assert g.calls[:2] == [("check", 0), ("restore", 2)], g.calls
    exports = [c for c in g.calls if c[0] == "export"]
    assert exports == [("export", 2, False), ("export", 3, False)], g.calls
    assert g.counters.events[-1]["event"] == "merge", g.counters.events
    g = Groups(fits=False)
    with pytest.raises(rg.Postponed, match=r"group \(2, 3\) does not fit"):
        await rg.merge(g, stays, joins, plan, direct=False)
    assert g.calls == [("check", 0), ("restore", 2)], g.calls
    monkeypatch.setattr(rg, "RESTORED_S", 0.05)
    g = Groups(steps_to_restore=10**9)
    with pytest.raises(GroupCommandError, match=r"instance 2: its group \(2, 3\) had not restored"):
        await rg.merge(g, stays, joins, plan, direct=False)
    assert not [c for c in g.calls if c[0] == "export"], g.calls


@pytest.mark.anyio
async def test_a_direct_merge_hands_the_joining_group_over():
    """`merge` directly (stand-in front door): the head's check, then the joining head's
    `HandOverGroup`, then the staying head's `MergeGroup` naming where each layer of the
    handed-over requests lies; their streams follow them. A joining head that refuses
    (its last exchange still running) postpones the merge with nothing else asked. A plan
    that also adds an instance serving alone: it hands its requests over first (as in a
    growth) and comes before the joining instances; a refusal then gives its requests up to
    the staying head (recomputed there)."""
    import types

    import shunter.cluster.remote_grow as rg
    from engine.cluster.counters import ClusterCounters
    from shunter.cluster.group_wire import GrowGroup
    from shunter.cluster.instance_grow import HandOverGroup, MergeGroup
    from shunter.cluster.remote_groups import GroupCommandError

    stays = GroupPlan(group_id=1, members=(0, 1), layers=stage_layers(LAYERS, 2))
    joins = GroupPlan(group_id=2, members=(2, 3), layers=stage_layers(LAYERS, 2))
    plan = GroupPlan(group_id=3, members=(0, 1, 2, 3), layers=stage_layers(LAYERS, 4))
    moved = tuple(types.SimpleNamespace(cluster_key=k) for k in (11, 12))

    class Groups:
        num_layers = LAYERS

        def __init__(self, refuse=False):
            self.calls, self.refuse, self.sent = [], refuse, []
            self.groups, self.counters = {0: stays, 2: joins}, ClusterCounters()
            self.coordinator = types.SimpleNamespace(send=self._sent)
            self.instances = [types.SimpleNamespace(alive=True, failure=None, _live={},
                                                    moved_to={}) for _ in range(5)]
            self.instances[2]._live = {11: "a", 12: "b"}

        async def _sent(self, msg):
            self.sent.append(msg)

        async def _command(self, head, make):
            msg = make(0)
            self.calls.append((type(msg).__name__, head))
            if isinstance(msg, HandOverGroup):
                if self.refuse:
                    raise GroupCommandError(f"instance {head}: not settled")
                return moved
            if isinstance(msg, MergeGroup):
                self.merge_msg = msg
            return {"pool_blocks": 9} if isinstance(msg, GrowGroup) else None

        async def restore(self, head):
            self.calls.append(("restore", head))
            return False

        async def _export(self, head, m):
            self.calls.append(("export", m))
            return (types.SimpleNamespace(cluster_key=20 + m),)

        async def _give_up(self, plan, adopted, exported, why):
            self.calls.append(("give up", tuple(exported), len(adopted)))

        async def note_kv(self, head):
            pass

    g = Groups()
    assert (await rg.merge(g, stays, joins, plan)).members == (0, 1, 2, 3)
    assert g.calls == [("GrowGroup", 0), ("HandOverGroup", 2), ("MergeGroup", 0)], g.calls
    m = g.merge_msg
    assert m.parts == ((2, range(0, 4)), (3, range(4, 8))), m.parts  # member 2 and 3's layers
    assert [k for k, _ in m.adopted] == [2, 2] and m.plan.layers == stage_layers(LAYERS, 4)
    assert g.instances[0]._live == {11: "a", 12: "b"} and not g.instances[2]._live
    assert g.groups == {0: m.plan}, g.groups
    assert g.counters.events[-1]["event"] == "merge" and g.counters.events[-1]["direct"]
    g = Groups(refuse=True)
    with pytest.raises(rg.Postponed, match="not settled"):
        await rg.merge(g, stays, joins, plan)
    assert g.calls == [("GrowGroup", 0), ("HandOverGroup", 2)], g.calls
    assert g.groups == {0: stays, 2: joins} and g.instances[2]._live, g.groups
    five = GroupPlan(group_id=3, members=(0, 1, 2, 3, 4), layers=stage_layers(LAYERS, 5))
    g = Groups()
    assert (await rg.merge(g, stays, joins, five)).members == (0, 1, 4, 2, 3)
    assert g.calls == [("GrowGroup", 0), ("export", 4), ("HandOverGroup", 2),
                       ("MergeGroup", 0)], g.calls
    m = g.merge_msg
    assert m.parts == ((3, range(0, 4)), (4, range(4, 8))), m.parts  # 2's and 3's old layers
    assert [k for k, _ in m.adopted] == [2, 3, 3], m.adopted  # 4's first, then 2's
    g = Groups(refuse=True)
    with pytest.raises(rg.Postponed, match="not settled"):
        await rg.merge(g, stays, joins, five)
    assert g.calls == [("GrowGroup", 0), ("export", 4), ("HandOverGroup", 2),
                       ("give up", (4,), 1)], g.calls
    assert g.groups == {0: stays, 2: joins}, g.groups
