"""A torch group's restore that failed before changing anything (gpu/restore_group.py
`RestoreNotStarted`) once no request is live: no step comes to try it again, so the head's
`LeaveGroup` does (shunter/cluster/instance_restore.py `_restored`: it waits for the step that
restores, and with nothing live and a failed try pending calls `dissolve_idle`), and
`dissolve_idle` gives the group up after `RESTORE_TRIES` tries in all (every member told, as
after a loss). Stand-ins for the engine and the group, no processes. Plants: `_restored` not
trying (`assert [] == ['dissolve']`, after its 30 s); `dissolve_idle` never giving up (the last
try raises `RestoreNotStarted: the test's fault: the rounds were late`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu.kunserve_runner import RESTORE_TRIES, KunServeTorchRunner
from gpu.restore_group import RestoreNotStarted


@pytest.mark.anyio
async def test_leave_group_tries_a_failed_restore_itself_once_nothing_is_live(anyio_backend):
    from shunter.cluster.instance_restore import _restored

    if anyio_backend != "asyncio":
        pytest.skip("the stand-ins do not depend on the event loop")
    calls, live = [], [(5,), (5,), ()]  # a request ends after two looks

    class Thread:
        async def run(self, fn, *args):
            return fn(*args)

    group = object()
    runner = SimpleNamespace(group=group, restore_failures=["the rounds were late"],
                             _thread=Thread())

    def dissolve():
        calls.append("dissolve")
        runner.group = None

    runner.dissolve_idle = dissolve

    async def inspect():
        return SimpleNamespace(scheduler=SimpleNamespace(live_requests=live.pop(0)))

    groups = SimpleNamespace(runner=runner, engine=SimpleNamespace(inspect=inspect))
    await _restored(groups, group)
    assert calls == ["dissolve"] and live == []
    runner.group = group  # requests live: the runner's next step tries it (restored there)
    looks = []

    async def restoring():
        looks.append(1)
        if len(looks) == 2:
            runner.group = None
        return SimpleNamespace(scheduler=SimpleNamespace(live_requests=(5,)))

    groups.engine.inspect = restoring
    await _restored(groups, group)
    assert calls == ["dissolve"] and len(looks) == 2


def test_dissolve_idle_gives_the_group_up_after_its_tries():
    runner = KunServeTorchRunner.__new__(KunServeTorchRunner)
    tries, lost = [], []

    def restore(tables, source, release):
        tries.append(release)
        raise RestoreNotStarted("the test's fault: the rounds were late")

    runner.group = SimpleNamespace(restore=restore, stage=SimpleNamespace(seqs={3: None}))
    runner.restore_source, runner.restore_failures = "peer", ["at the step"]
    runner.lose_group = lambda exc, lost_rank=None, **kw: lost.append((str(exc), kw))
    for _ in range(RESTORE_TRIES - 2):
        with pytest.raises(RestoreNotStarted):
            runner.dissolve_idle()
    assert runner.dissolve_idle() is True  # the last try: given up
    assert tries == [(3,)] * (RESTORE_TRIES - 1)
    (why, kw), = lost
    assert kw == {"lost": -1} and f"restore failed {RESTORE_TRIES} times" in why, lost


@pytest.mark.anyio
async def test_leave_group_for_a_group_already_ended_answers_it_over(anyio_backend):
    """A group that ended at a step since the front door last asked (restored there after a
    failed try, or given up as after a loss): its `LeaveGroup` answers it over, so the front
    door lets it go. Before, it answered "this instance leads no group", the front door kept
    the group and asked again every round for good (reviewer s32, review-2.md)."""
    from shunter.cluster.instance_restore import leave_here

    if anyio_backend != "asyncio":
        pytest.skip("the stand-ins do not depend on the event loop")
    for how in ("restored", "lost"):
        runner = SimpleNamespace(group=None, last_group=object(), last_ended=how)
        out = await leave_here(SimpleNamespace(runner=runner, engine=None))
        assert out == {"ended_already": how, "restored_at_once": False}, out
    never = SimpleNamespace(runner=SimpleNamespace(group=None, last_group=None), engine=None)
    with pytest.raises(RuntimeError, match="leads no group"):
        await leave_here(never)



def test_the_runner_records_how_its_group_ended():
    runner = KunServeTorchRunner.__new__(KunServeTorchRunner)
    runner._seqs, told = {}, []
    runner.group = SimpleNamespace(
        ranks=(0, 1), recover_from_host=lambda rank, why=None: told.append(rank))
    runner.lose_group(RuntimeError("the test's give-up"), lost=-1)
    assert (runner.group, runner.last_ended, told) == (None, "lost", [-1])
    restored = SimpleNamespace(restore=lambda tables, source, release: None,
                               stage=SimpleNamespace(seqs={}))
    runner.group, runner.restore_source, runner.restore_failures = restored, "peer", []
    assert runner.dissolve_idle() is True
    assert (runner.group, runner.last_group, runner.last_ended) == (None, restored, "restored")
