"""A KunServe restore waits for its group's KV exchange to settle (shunter/cluster/
instance_restore.py `_settled`, step 0 of `leave_here`): a request whose KV still moves into
the group when the restore's step runs is not restored (an adopted one never set up on the
head is in no member's sequences: its KV is dropped with the group) and no one tells the
scheduler of its arrival afterwards (the arrivals task ends with the group), so it would wait
for ever. Stand-ins for the instance's groups, engine and runner (no processes): the wait
returns only once nothing is unsettled, and a restore whose exchange does not settle in
`SETTLE_S` is refused (`PoolTooSmall`) before the scheduler is asked for anything.

(The other half, a request whose KV arrived but that no step ran since it did: every member
writes its chunks into its blocks before the restore reads them: tests/gpu/
test_kunserve_torch.py `test_a_restore_before_the_exchange_landed_restores_its_requests_kv`.)
"""

from __future__ import annotations

import types

import anyio
import attrs
import pytest

from engine.cluster.adoption import PoolTooSmall
from shunter.cluster import instance_restore


@attrs.define(eq=False)
class _Group:
    """The GroupRunner fields `gpu/group_grow.py` `unsettled` reads."""

    expect: set = attrs.Factory(set)  # still arriving on some member
    adopted: tuple = ()
    seqs: dict = attrs.Factory(dict)  # the head's stage's sequences
    set_up: set = attrs.Factory(set)
    ranks: tuple = (0, 1)

    def exchanging(self) -> set:
        return set(self.expect)

    @property
    def stage(self):
        return types.SimpleNamespace(seqs=self.seqs)


class _Thread:
    async def run(self, fn, *args):
        return fn(*args)


class _Engine:
    def __init__(self, live: tuple) -> None:
        self.live = live

    async def inspect(self):
        return types.SimpleNamespace(scheduler=types.SimpleNamespace(live_requests=self.live))

    @property
    def policy(self):  # read by `leave_here` once settled, before it asks for the shrink
        raise AssertionError("the restore went on (to the shrink) before the exchange settled")


def _groups(group: _Group, live: tuple, arrivals: set | None = None):
    runner = types.SimpleNamespace(group=group, _thread=_Thread(),
                                   _model_config=types.SimpleNamespace(num_layers=4))
    return types.SimpleNamespace(engine=_Engine(live), runner=runner, arrivals=(
        (group, arrivals) if arrivals is not None else None))


def _adopted(*rids):
    return tuple(types.SimpleNamespace(request_id=r) for r in rids)


def test_the_restore_waits_until_nothing_is_unsettled(monkeypatch):
    """Request 1 still arriving, 2 adopted and never set up, 3 arrived but its arrival not yet
    told to the scheduler: the wait goes on until all three settle (here one after another,
    a few polls apart), and ended requests (4, adopted and never set up) do not count."""
    monkeypatch.setattr(instance_restore, "SETTLE_S", 60.0)
    group = _Group(expect={1}, adopted=_adopted(2, 4))
    unheard = {3}
    groups = _groups(group, live=(1, 2, 3), arrivals=unheard)
    settled_at: list[str] = []

    async def settle():
        for change in ("1 arrived", "2 set up", "3 told"):
            for _ in range(3):
                await anyio.sleep(instance_restore.POLL_S)
            if change == "1 arrived":
                group.expect.clear()
            elif change == "2 set up":
                group.set_up.add(2)
            else:
                unheard.clear()
            settled_at.append(change)

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(settle)
            await instance_restore._settled(groups, group)
            done = list(settled_at)
            tg.cancel_scope.cancel()
        return done

    assert anyio.run(main) == ["1 arrived", "2 set up", "3 told"]


@pytest.mark.parametrize("unsettled", ["arriving", "adopted", "unheard"])
def test_a_restore_whose_exchange_does_not_settle_is_refused(monkeypatch, unsettled):
    monkeypatch.setattr(instance_restore, "SETTLE_S", 0.05)
    group = _Group(expect={7} if unsettled == "arriving" else set(),
                   adopted=_adopted(7) if unsettled == "adopted" else ())
    groups = _groups(group, live=(5, 7), arrivals={7} if unsettled == "unheard" else set())
    with pytest.raises(PoolTooSmall, match=r"requests \[7\] still wait for its KV exchange"):
        anyio.run(instance_restore.leave_here, groups)


def test_a_settled_exchange_does_not_hold_the_restore(monkeypatch):
    """Nothing unsettled among the live requests: the wait returns at its first look (an
    ended request still arriving, 8, holds nothing)."""
    monkeypatch.setattr(instance_restore, "SETTLE_S", 0.0)
    group = _Group(expect={8}, adopted=_adopted(2), set_up={2})
    groups = _groups(group, live=(1, 2), arrivals={8})
    anyio.run(instance_restore._settled, groups, group)
