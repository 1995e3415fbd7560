"""Every request ends and nothing leaks when clients cancel at awkward moments of KunServe's
groups (issue 16), on two simulated instances (tests/sim/chaos_kunserve.py says what is
watched): a burst forms a group while requests run (exported from the member, streams handed to
the head, KV exchanged in flight), a trickle of short requests keeps some live through the
restore (layers and KV prefetched back, then the group dissolves), and clients cancel at random
times, after some tokens, and at each of those moments. Afterwards every client got its end or
left, no cancelled request ran on for nobody, every pool is whole (back to its own size, no
block allocated) and no group, restore or prefetch is left. Virtual time."""

from __future__ import annotations

import random
from collections import Counter

import anyio
import pytest
import trio
import trio.testing

from actors.frontend import Frontend
from actors.scheduler import Scheduler
from engine.config import EngineConfig
from policies import policy_path
from shunter.cluster import groups as groups_module
from shunter.cluster.cluster import Cluster
from tests.conftest import slow_scale
from tests.sim.chaos_bros import Client, canceller, client_errors, drive
from tests.sim.chaos_kunserve import MOMENTS, KunWatch, patch

BLOCKS = 300


def clients_for(seed: int) -> list[Client]:
    rng = random.Random(seed)
    burst = [Client(f"burst {i}", [rng.randrange(1, 1000) for _ in range(399)], None, 200,
                    start_s=i * 0.005) for i in range(40)]
    trickle = [Client(f"trickle {i}", [rng.randrange(1, 1000) for _ in range(rng.randint(20, 60))],
                      None, rng.randint(20, 60), start_s=0.5 + 0.25 * i) for i in range(36)]
    for c in burst + trickle:  # a fifth give up at a random time, a tenth after some tokens
        if (u := rng.random()) < 0.2:
            c.cancel_after_s = rng.uniform(0.0, 3.0)
        elif u < 0.3:
            c.stop_after_tokens = rng.randint(1, c.max_tokens - 1)
    return burst + trickle


async def _chaos(seed: int, watch: KunWatch):
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=BLOCKS,
                          policy=policy_path("kunserve"))
    async with Cluster.start(config, instances=2, kind="inprocess") as cluster:
        clients = clients_for(seed)
        watch.cancel = canceller(clients)
        watch.live_keys = lambda: [c.stream.request_id for c in clients
                                   if c.stream is not None and c.stream.request_id is not None
                                   and c.finish is None and not c.left]
        with anyio.fail_after(300):  # virtual seconds: a lost request fails here
            await drive(cluster, clients)
            snap = await cluster.wait_idle()
            for _ in range(200):  # low load: 4 calm seconds, then the restore's copies
                if not cluster.groups.groups and not cluster.groups.busy:
                    break
                await anyio.sleep(0.1)
            after = await cluster.inspect()
        return clients, snap, after, cluster.groups


def run(monkeypatch, seed: int, cancel_p: float = 0.3):
    watch = KunWatch(random.Random(seed), cancel_p=cancel_p)
    patch(monkeypatch, watch)
    clients, snap, after, groups = trio.run(
        _chaos, seed, watch, clock=trio.testing.MockClock(autojump_threshold=0))
    return watch, clients, snap, after, groups


def problems(watch, clients, snap, after, groups) -> list[str]:
    out = client_errors(clients) + watch.ran_on()
    for i, s in enumerate(after.snapshots):
        if s is None:
            out.append(f"instance {i} is down")
            continue
        if s.scheduler.live_requests:
            out.append(f"instance {i}: live requests {s.scheduler.live_requests}")
        if s.allocator.allocated_blocks or s.allocator.free_blocks != s.allocator.total_blocks:
            out.append(f"instance {i}: {s.allocator.allocated_blocks} blocks allocated, "
                       f"{s.allocator.free_blocks} of {s.allocator.total_blocks} free")
        if s.scheduler.total_blocks != BLOCKS or s.allocator.total_blocks != BLOCKS:
            out.append(f"instance {i}: pool of {s.scheduler.total_blocks} / "
                       f"{s.allocator.total_blocks} blocks, not {BLOCKS}")
    if groups.groups or groups.busy or groups.prefetching or groups.one_step:
        out.append(f"groups left: {groups.groups}, busy {groups.busy}, prefetching "
                   f"{list(groups.prefetching)}, one-step {list(groups.one_step)}")
    if any(v.in_flight for v in after.views):
        out.append(f"the coordinator counts requests in flight: {after.views}")
    return out


def test_cancels_while_grouping_exchanging_and_restoring_end_every_request(monkeypatch):
    """Each seed's run checked whole; over the seeds, clients were cancelled at every moment
    watched (not vacuous: in probe runs, seeds 0-3, each moment 1-17 times a seed, but the
    restore's start and its copies 0-3 times)."""
    hits = Counter()
    for seed in range(slow_scale(8, 3)):
        with monkeypatch.context() as m:
            watch, clients, snap, after, groups = run(m, seed)
        assert groups.counters.groups_formed >= 1 and groups.counters.restores >= 1
        assert problems(watch, clients, snap, after, groups) == [], seed
        hits.update(watch.hits)
    assert [m for m in MOMENTS if not hits[m]] == [], hits


def _deliver_without_the_resend(self, out):
    """The frontend as it was: a moved stream's cancel is not sent again."""
    s = self._streams.get(out.request_id)
    if s is not None:
        s.moved = False
    return _deliver(self, out)


def _finish_keeping_cancelled_blocks(self, req, reason, error=None):
    """A cancelled request's blocks are not released (only on an instance that adopted some)."""
    if reason == "cancelled" and self._seat.stages > 1:
        req.known_to_executor, req.blocks = False, 0
    _finish(self, req, reason, error)


async def _no_restore(groups, g, ask):
    return None


_deliver, _finish = Frontend._deliver, Scheduler._finish
PLANTS = {
    "cancel lost in a move": (Frontend, "_deliver", _deliver_without_the_resend,
                              "ran on for"),
    "cancelled blocks kept": (Scheduler, "_finish", _finish_keeping_cancelled_blocks,
                              "shrinking to 300 blocks"),  # the restore's shrink fails
    "never restored": (groups_module, "restore", _no_restore, "groups left"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_fault_is_reported(monkeypatch, plant):
    owner, name, replacement, message = PLANTS[plant]
    found = []
    for seed in range(3):
        with monkeypatch.context() as m:
            m.setattr(owner, name, replacement)
            try:
                found = problems(*run(m, seed))
            except Exception as exc:  # noqa: BLE001 - an instance failing under the plant
                found = [repr(exc)] + [repr(e) for e in getattr(exc, "exceptions", ())]
        if found:
            break
    assert any(message in p for p in found), found
