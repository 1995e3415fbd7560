"""Chaos on KunServe's groups (issue 16) on the simulator's instances: clients cancel requests
while a group forms (their requests exported from a member, their streams handed to the head,
their KV exchanged in flight), while grouped, and while the restore copies layers and KV back.
Used by tests/sim/test_chaos_kunserve_sim.py.

`KunWatch` wraps, while a run lasts:
- `SimGroups._form`, `_move_cancels`, `_exchange`, `act` and `restore` (shunter/cluster/
  groups.py, sim_restore.py): at each, the clients of requests in that state are cancelled with
  a seeded probability (`hits` counts them per moment: `MOMENTS`), and at random times while
  the restore's copies run;
- every engine's frontend (`Frontend._deliver`): what reaches a stream whose client has gone.
  A cancelled request stops within a step: its abort lands before its next step is planned,
  so a gone stream gets at most the output of the step in flight. More than `RUN_ON` outputs
  after its client left means the cancel was lost and the request ran on for nobody;
- every scheduler's `_finish`: the reason each request ended with.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import anyio
import attrs

from actors.frontend import Frontend
from actors.scheduler import Scheduler
from shunter.cluster import groups as groups_module
from shunter.cluster.groups import SimGroups

RUN_ON = 2
"""Outputs a gone stream may still get: the step in flight when the abort landed, and one
more for a cancel that crosses a step boundary."""
MOMENTS = ("forming", "moving", "exchanging", "grouped", "restoring", "prefetching")


@attrs.define
class KunWatch:
    rng: random.Random
    cancel_p: float = 0.3
    cancel: Callable[[int], bool] = lambda key: False
    """Cancels the client of cluster request `key`; False if it has ended."""
    live_keys: Callable[[], list[int]] = lambda: []
    hits: Counter = attrs.field(factory=Counter)
    after_gone: Counter = attrs.field(factory=Counter)
    """Non-final outputs that reached a gone stream, by stream."""
    gone_final: dict[int, str | None] = attrs.field(factory=dict)
    finishes: Counter = attrs.field(factory=Counter)
    """Scheduler endings by reason."""

    def maybe_cancel(self, moment: str, keys, p: float | None = None) -> None:
        for key in sorted(keys):
            if self.rng.random() < (self.cancel_p if p is None else p) and self.cancel(key):
                self.hits[moment] += 1

    def ran_on(self) -> list[str]:
        return [f"a cancelled request ran on for {n} outputs after its client left"
                for n in self.after_gone.values() if n > RUN_ON]


def _keys_of(groups: SimGroups, engine, rids) -> list[int]:
    """Cluster keys of `engine`'s requests `rids` (adopted ones through `_cancel_to`)."""
    rids, out = set(rids), []
    for inst in groups.instances:
        for key, (eng, rid) in inst._cancel_to.items():
            if eng is engine and rid in rids:
                out.append(key)
        if inst.engine is engine:
            out += [key for key, rid in inst._ids.items()
                    if rid in rids and key not in inst._cancel_to]
    return out


def patch(monkeypatch, watch: KunWatch) -> None:
    form, move_cancels, exchange = SimGroups._form, SimGroups._move_cancels, SimGroups._exchange
    restore, act = groups_module.restore, SimGroups.act
    deliver, finish = Frontend._deliver, Scheduler._finish

    async def forming(self, g):
        watch.maybe_cancel("forming", watch.live_keys())
        await form(self, g)

    def moving(self, src, head, new_ids):
        a = self.instances[src]
        watch.maybe_cancel("moving", [k for k, rid in a._ids.items() if rid in new_ids])
        move_cancels(self, src, head, new_ids)

    def exchanging(self, g, waiting, sources):
        exchange(self, g, waiting, sources)
        head = self.instances[g.head].engine
        watch.maybe_cancel("exchanging", _keys_of(self, head, [q.id for q in waiting]))

    async def restoring(groups, g, ask):
        watch.maybe_cancel("restoring", watch.live_keys())

        async def later() -> None:  # and while its copies run (the prefetch, then the step's)
            for _ in range(4):
                await anyio.sleep(watch.rng.uniform(0.0, 0.4))
                if groups.busy:
                    watch.maybe_cancel("prefetching", watch.live_keys())

        groups._tg.start_soon(later)
        await restore(groups, g, ask)

    async def acting(self, action, stats):
        if self.groups:  # the monitor's rounds come every 50 ms: one client in ~50 a round
            watch.maybe_cancel("grouped", watch.live_keys(), p=watch.cancel_p / 15)
        await act(self, action, stats)

    async def delivered(self, out):
        s = self._streams.get(out.request_id)
        if s is not None and s.gone:
            if out.finish_reason is None:
                watch.after_gone[id(s)] += 1
            else:
                watch.gone_final[id(s)] = out.finish_reason
        await deliver(self, out)

    def finished(self, req, reason, error=None):
        watch.finishes[reason if error is None else f"{reason}: {error}"] += 1
        finish(self, req, reason, error)

    monkeypatch.setattr(SimGroups, "_form", forming)
    monkeypatch.setattr(SimGroups, "_move_cancels", moving)
    monkeypatch.setattr(SimGroups, "_exchange", exchanging)
    monkeypatch.setattr(SimGroups, "act", acting)
    monkeypatch.setattr(groups_module, "restore", restoring)
    monkeypatch.setattr(Frontend, "_deliver", delivered)
    monkeypatch.setattr(Scheduler, "_finish", finished)
