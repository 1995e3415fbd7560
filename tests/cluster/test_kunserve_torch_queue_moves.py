"""The torch cluster's group manager (shunter/cluster/remote_groups.py) moves queued requests by
the simulator's rule, the one mechanism both use (engine/cluster/drop_plan.py `queue_moves`):
an overloaded instance serving alone sends its queue to a group head that has room and no queue
of its own; a head that queues takes none (the instance is left to the drop trigger). Stand-ins
for the instances' links; the monitor's round (`act`) decides."""

from __future__ import annotations

import types

import anyio
import pytest


class _Stats:
    def __init__(self, waiting: int, queued_tokens: int, free_blocks: int) -> None:
        self.waiting, self.queued_tokens, self.free_blocks = waiting, queued_tokens, free_blocks


@pytest.mark.anyio
@pytest.mark.parametrize("head_waiting", [0, 1])
async def test_queued_requests_move_only_to_a_head_without_a_queue(anyio_backend, head_waiting):
    if anyio_backend != "asyncio":
        pytest.skip("the stand-ins do not depend on the event loop")
    from engine.cluster.drop_plan import GroupPlan
    from shunter.cluster.group_wire import AdoptQueued, ExportQueued, GroupAnswer
    from shunter.cluster.remote_groups import RemoteGroups

    asked = []

    class Instance:
        def __init__(self, index: int) -> None:
            self.index, self.alive, self._live, self.moved_to = index, True, {}, {}

        async def _ask(self, make):
            msg = make(0)
            asked.append((self.index, type(msg).__name__))
            if isinstance(msg, ExportQueued):  # instance 2's two queued requests
                value = [types.SimpleNamespace(cluster_key=k) for k in (21, 22)]
            else:
                assert isinstance(msg, AdoptQueued), msg
                value = len(msg.moved)
            return GroupAnswer(key=0, value=value)

    instances = [Instance(i) for i in range(4)]
    for k in (21, 22):
        instances[2]._live[k] = f"stream {k}"
    groups = RemoteGroups(instances, coordinator=None, base_pools=[24] * 4, num_layers=4,
                          block_size=4)
    groups.groups = {0: GroupPlan(group_id=1, members=(0, 1), layers=(range(2), range(2, 4)))}
    stats = [_Stats(head_waiting, 8 * head_waiting, 60),  # head 0: room for 240 tokens
             _Stats(0, 0, 0),                             # its member
             _Stats(2, 80, 4),                            # alone: 80 tokens queued, 16 fit
             _Stats(0, 0, 20)]                            # alone, nothing queued
    with anyio.fail_after(10):
        await groups.act(None, stats)
    if head_waiting:
        assert asked == [] and groups.counters.rescheduled_requests == 0
        assert instances[2]._live == {21: "stream 21", 22: "stream 22"}
    else:
        assert asked == [(2, "ExportQueued"), (0, "AdoptQueued")], asked
        assert groups.counters.rescheduled_requests == 2
        assert instances[0]._live == {21: "stream 21", 22: "stream 22"}
        assert instances[2].moved_to == {21: instances[0], 22: instances[0]}
