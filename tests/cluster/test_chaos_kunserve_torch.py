"""Clients cancel at awkward moments of a KunServe group of torch instance processes (issue 16),
the setup of tests/cluster/test_kunserve_torch_cluster_restore.py (two instances of the tiny
6-layer model, two requests streaming on each, a group formed by hand, then restored with the
prefetch on): one request is cancelled while the group forms (the member hands its requests
over and the head exchanges their KV), one while grouped, one while the restore's prefetch and
step run, the last once the instances serve alone again; which request at which moment, and
after how long, is drawn from the seed. Every request ends (nothing live on any instance), no
group is left, both pools are whole at their own size with every block free, and every token
each client read equals transformers' greedy token. Whether a cancel lands before the group
has formed (or the restore finished) is up to timing; each run is checked whole either way."""

from __future__ import annotations

import random

import anyio
import pytest

from engine.cluster.drop_plan import GroupPlan
from engine.cluster.plan import stage_layers
from shunter.cluster.cluster import Cluster
from tests.conftest import slow_scale
from tests.cluster.test_kunserve_torch_grow import LAYERS, SOLO_BLOCKS, grow_config, grow_model
from tests.cluster.test_kunserve_torch_grow_faults import Streams, _references
from tests.reference import Reference, assert_matches

__all__ = ["grow_config", "grow_model"]  # the fixtures


def _delay(rng: random.Random) -> float:
    """1 ms to 0.3 s, log-uniform: early in the call, late in it, or just after it."""
    return 10 ** rng.uniform(-3.0, -0.5)


async def _cancel_after(run: Streams, i: int, delay_s: float, landed: dict, moment: str,
                        done: anyio.Event) -> None:
    await anyio.sleep(delay_s)
    landed[moment] = not done.is_set()  # the cancel came before the moment's call returned
    run.scopes[i].cancel()


async def _chaos(grow_config, seed: int) -> dict:
    from shunter.cluster.launch import LocalLauncher

    rng = random.Random(seed)
    launcher = LocalLauncher("asyncio")
    instances = [launcher.start_process(i, grow_config) for i in range(2)]
    prompts = [[rng.randrange(2, 320) for _ in range(6)] for _ in range(4)]
    order = rng.sample(range(4), 4)  # cancelled while forming, grouped, restoring, alone
    out: dict = {"prompts": prompts, "order": order, "landed": {}}
    try:
        async with Cluster.start(grow_config, attach=instances,
                                 monitor_interval_s=0.02) as cluster:
            groups, run = cluster.groups, Streams(cluster, prompts)
            with anyio.fail_after(150):
                async with anyio.create_task_group() as tg:
                    await run.start(tg)
                    formed = anyio.Event()
                    tg.start_soon(_cancel_after, run, order[0], _delay(rng), out["landed"],
                                  "forming", formed)
                    began = anyio.current_time()
                    await groups.form(GroupPlan(group_id=1, members=(0, 1),
                                                layers=stage_layers(LAYERS, 2)))
                    formed.set()
                    out["forming_s"] = anyio.current_time() - began
                    await run.past({i: len(run.got[i]) for i in order[1:]})
                    run.scopes[order[1]].cancel()  # grouped
                    await run.past({i: len(run.got[i]) for i in order[2:]})
                    restored = anyio.Event()
                    tg.start_soon(_cancel_after, run, order[2], _delay(rng), out["landed"],
                                  "restoring", restored)
                    began = anyio.current_time()
                    out["restored"] = await groups.restore(0)
                    restored.set()
                    out["restoring_s"] = anyio.current_time() - began
                    await run.past({order[3]: len(run.got[order[3]])})
                    run.cancel()
                with anyio.fail_after(30):
                    while groups.groups:
                        await anyio.sleep(0.01)
                out["snap"] = await cluster.wait_idle()
                out["live"] = [sorted(i._live) for i in cluster.instances]
                out["groups"] = dict(groups.groups)
                out["report"] = groups.report(0.0)
    finally:
        launcher.shutdown(timeout_s=0)
    out["got"], out["ended"] = run.got, run.ended
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(slow_scale(4, 1)))
async def test_cancels_while_forming_grouped_and_restoring_end_every_request(
        anyio_backend, grow_config, grow_model, seed):
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    out = await _chaos(grow_config, seed)
    print(f"\nchaos: order {out['order']}, cancels before the call returned {out['landed']} "
          f"(forming {out['forming_s']:.3f} s, restoring {out['restoring_s']:.3f} s), "
          f"tokens {[len(g) for g in out['got'].values()]}, events "
          f"{[e['event'] for e in out['report']['events']]}")
    assert out["restored"]
    assert out["ended"] == {}, "no request may end on its own: each is cancelled"
    assert not out["groups"] and out["live"] == [[], []], (out["groups"], out["live"])
    for k, snap in enumerate(out["snap"].snapshots):
        s, a = snap.scheduler, snap.allocator
        assert s.total_blocks == SOLO_BLOCKS and s.free_blocks == SOLO_BLOCKS, (k, s)
        assert a.allocated_blocks == 0 and a.free_blocks == a.total_blocks == SOLO_BLOCKS, (k, a)
    refs = _references(grow_model, out["prompts"], max(len(g) for g in out["got"].values()))
    for i, got in out["got"].items():
        assert len(got) >= 2, (i, got)  # each streamed before the chaos began
        assert_matches(got, Reference(tokens=refs[i].tokens[:len(got)],
                                      top2=refs[i].top2[:len(got)]), f"request {i}")
