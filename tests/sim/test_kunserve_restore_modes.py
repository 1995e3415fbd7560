"""KunServe's restore settings on simulated instances (shunter/cluster/sim_restore.py, §4.4):
the policy's `restore_prefetch on|off` and `restore_from peer|host` on the same burst. A burst
groups two instances, two long requests run across the restore, and:
- with the prefetch off, the head's first step alone waits for the copies over every link: the
  stall equals the slowest member's copy time for the bytes the model moves (its dropped
  weights, and the KV of the head's live requests for its layers), computed here from the
  restore's used blocks, the model's shape and the links, and the long requests' tokens show a
  gap at least that long;
- from the host, the weights go over the host link (the one-step stall is the host's time for
  them, not the pipeline link's; with the prefetch on, the pipeline link carries only the KV);
- every request ends with all its tokens, in each of the four."""

from __future__ import annotations

import anyio
import pytest
import trio
import trio.testing

import shunter
from engine.config import EngineConfig
from policies import policy_path
from shunter.cluster.cluster import Cluster


def _policy(tmp_path, prefetch: str, source: str) -> str:
    path = tmp_path / f"k_{prefetch}_{source}.policy"
    path.write_text(f'policy k extends "{policy_path("kunserve")}" {{\n'
                    f'  memory {{ restore_prefetch {prefetch}; restore_from {source} }}\n}}\n')
    return str(path)


async def _burst(policy: str):
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300, policy=policy)
    async with Cluster.start(config, instances=2, kind="inprocess") as cluster:
        ends, long = [], []

        async def one(i: int, max_tokens: int, out: list) -> None:
            await anyio.sleep(i * 0.005)
            done = await cluster.complete(list(range(1, 400)), shunter.SamplingParams(
                max_tokens=max_tokens, ignore_eos=True))
            out.append((done.finish_reason, len(done.token_ids), done.timeline))

        with anyio.fail_after(200):  # virtual seconds: a lost request fails here
            async with anyio.create_task_group() as tg:
                for i in range(40):
                    tg.start_soon(one, i, 200, ends)
                for i in range(2):  # across the restore (4 calm seconds after the burst)
                    tg.start_soon(one, i, 1500, long)
        return ends, long, cluster.groups


def _run(tmp_path, prefetch: str, source: str):
    return trio.run(_burst, _policy(tmp_path, prefetch, source),
                    clock=trio.testing.MockClock(autojump_threshold=0))


def _expected(groups, event, source: str) -> tuple[list[int], list[int], float]:
    """Weights and KV bytes per member (the head first), and the one-step stall, from the
    model's shape and the links (independently of sim_restore.py)."""
    model, layers, link = groups.model, groups.model.num_layers, groups.link
    weights, kv, times = [], [], []
    for i, kept in enumerate(event["kept_layers"]):
        w = int(model.weight_bytes / layers * (layers - kept))
        k = 0 if i == 0 else int(event["used_blocks"] * groups.block_bytes * kept / layers)
        weights.append(w)
        kv.append(k)
        if source == "peer":
            times.append(link.latency_s + (w + k) / link.bytes_per_s)
        else:
            kv_s = link.latency_s + k / link.bytes_per_s if k else 0.0
            times.append(max(w / groups.host_bytes_per_s, kv_s))
    return weights, kv, max(times)


@pytest.mark.parametrize("source", ["peer", "host"])
def test_a_one_step_restore_stalls_the_head_for_the_copies(tmp_path, source):
    ends, long, groups = _run(tmp_path, "off", source)
    assert sorted({(r, k) for r, k, _ in ends}) == [("length", 200)] and len(ends) == 40
    assert sorted((r, k) for r, k, _ in long) == [("length", 1500)] * 2
    c = groups.counters
    assert c.groups_formed == 1 and c.restores == 1
    (event,) = [e for e in c.events if e["event"] == "restore"]
    assert (event["prefetched"], event["source"]) == (False, source)
    weights, kv, stall = _expected(groups, event, source)
    assert event["used_blocks"] > 0 and sum(kv) > 0  # live requests' KV moved
    assert (event["weight_bytes"], event["kv_bytes"]) == (sum(weights), sum(kv))
    assert event["stall_s"] == pytest.approx(stall, rel=1e-9)
    net = groups.instances[event["members"][0]].engine.backend.runner.network
    assert net.restore_stalls == [pytest.approx(stall, rel=1e-9)]
    # the long requests were decoding at the restore: their tokens stop for the copies
    gaps = [max(b - a for a, b in zip(t.token_times, t.token_times[1:])) for _, _, t in long]
    assert min(gaps) >= stall


def test_from_the_host_the_weights_leave_the_pipeline_link(tmp_path):
    _, _, peer = _run(tmp_path, "off", "peer")
    _, _, host = _run(tmp_path, "off", "host")
    (p,) = [e for e in peer.counters.events if e["event"] == "restore"]
    (h,) = [e for e in host.counters.events if e["event"] == "restore"]
    # the same bytes; the host's 32 GB/s beats the pipeline link's 7.83 GB/s for the weights
    assert p["weight_bytes"] == h["weight_bytes"] > 0
    assert h["stall_s"] < p["stall_s"]


def test_prefetched_from_the_host_the_pipeline_link_carries_only_the_kv(tmp_path):
    ends, long, groups = _run(tmp_path, "on", "host")
    assert sorted({(r, k) for r, k, _ in ends}) == [("length", 200)] and len(ends) == 40
    assert sorted((r, k) for r, k, _ in long) == [("length", 1500)] * 2
    (event,) = [e for e in groups.counters.events if e["event"] == "restore"]
    assert (event["prefetched"], event["source"], event["stall_s"]) == (True, "host", 0.0)
    net = groups.instances[event["members"][0]].engine.backend.runner.network
    assert sum(x.sent_bytes for x in net.exchanges) == event["kv_bytes"] > 0
    assert net.restore_stalls == []
    # it took as long as the slower of the host copies and the KV over the pipeline link
    weights, kv, slowest = _expected(groups, event, "host")
    assert event["restore_s"] >= slowest


def test_prefetched_from_peers_the_pipeline_link_carries_weights_and_kv(tmp_path):
    ends, long, groups = _run(tmp_path, "on", "peer")
    assert len(ends) == 40 and sorted((r, k) for r, k, _ in long) == [("length", 1500)] * 2
    (event,) = [e for e in groups.counters.events if e["event"] == "restore"]
    net = groups.instances[event["members"][0]].engine.backend.runner.network
    assert sum(x.sent_bytes for x in net.exchanges) == event["copied_bytes"]
    assert event["copied_bytes"] == event["weight_bytes"] + event["kv_bytes"]
    assert net.restore_stalls == [] and event["stall_s"] == 0.0


def test_a_replaced_policy_s_restore_settings_reach_the_groups_follow():
    """What the next restore reads: `SimGroups.follow` takes a replaced policy's settings (the
    restore itself reads `groups.restore_prefetch`/`restore_from`, as the tests above show)."""
    from types import SimpleNamespace

    from engine.policy import MemorySettings
    from shunter.cluster.groups import SimGroups

    groups = object.__new__(SimGroups)  # (no instances: only the settings are read)
    groups.instances = []
    groups.follow(SimpleNamespace(memory=MemorySettings(restore_prefetch=False,
                                                        restore_from="host")))
    assert (groups.restore_prefetch, groups.restore_from) == (False, "host")
