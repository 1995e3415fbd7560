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


PROMPT = 399


def _layer_bytes(model, block_bytes: int) -> int:
    """A decoder layer's weights (attention, MLP, two norms), in whole KV blocks: the torch
    arena starts each layer on a block boundary; the embeddings and LM head stay put."""
    h, q, kv = model.hidden_size, model.num_heads * model.head_dim, \
        model.num_kv_heads * model.head_dim
    params = 2 * h * q + 2 * h * kv + 3 * h * model.intermediate_size + 2 * h
    return -(-params * model.dtype_bytes // block_bytes) * block_bytes


def _computed(long, event) -> list[int]:
    """Each long request's tokens with KV at the restore's step, from what its client saw: its
    prompt and the tokens it got before the group stopped, less the last (sampled, its KV not
    written yet)."""
    return [PROMPT + sum(t <= event["stopped"] + 1e-9 for t in tl.token_times) - 1
            for _, _, tl in long]


def _expected(groups, event, long) -> dict:
    """What moves, per member (the head first), before and at the restore's step, and the
    stall, from the requests' lengths, the model's shape and the links (independently of
    sim_restore.py): with the prefetch the full blocks before and each one's partly filled last
    block at the step, without it every block at the step."""
    model, layers, link, bs = groups.model, groups.model.num_layers, groups.link, 16
    computed = _computed(long, event)
    full, partial = sum(c // bs for c in computed), sum(1 for c in computed if c % bs)
    ahead, at_step = (full, partial) if event["prefetched"] else (0, full + partial)
    out: dict = {"weights": [], "before": [], "at": [], "blocks": full + partial}
    times = []
    for i, kept in enumerate(event["kept_layers"]):
        w = _layer_bytes(model, groups.block_bytes) * (layers - kept)
        block = 0 if i == 0 else groups.block_bytes * kept / layers
        out["weights"].append(w)
        out["before"].append(int(ahead * block))
        out["at"].append(k := int(at_step * block))
        w_at = 0 if event["prefetched"] else w
        kv_s = link.latency_s + k / link.bytes_per_s if k else 0.0
        if event["source"] == "peer":
            times.append(link.latency_s + (w_at + k) / link.bytes_per_s if w_at + k else 0.0)
        else:
            times.append(max(w_at / groups.host_bytes_per_s, kv_s))
    out["stall"] = max(times)
    return out


def _check_bytes(groups, event, long) -> dict:
    x = _expected(groups, event, long)
    # the long requests' KV is all the pool holds (at the decision: the prefetch adds to it)
    assert 0 < event["used_blocks"] <= x["blocks"]
    assert event["prefetched"] or event["used_blocks"] == x["blocks"]
    assert event["weight_bytes"] == sum(x["weights"])
    assert event["weight_bytes_at"] == (0 if event["prefetched"] else sum(x["weights"]))
    assert (event["kv_bytes_before"], event["kv_bytes_at"]) == (sum(x["before"]), sum(x["at"]))
    assert event["stall_s"] == pytest.approx(x["stall"], rel=1e-9, abs=1e-12)
    net = groups.instances[event["members"][0]].engine.backend.runner.network
    assert net.restore_stalls == ([pytest.approx(x["stall"], rel=1e-9)] if x["stall"] else [])
    return x


@pytest.mark.parametrize("source", ["peer", "host"])
def test_a_one_step_restore_stalls_the_head_for_the_copies(tmp_path, source):
    ends, long, groups = _run(tmp_path, "off", source)
    assert sorted({(r, k) for r, k, _ in ends}) == [("length", 200)] and len(ends) == 40
    assert sorted((r, k) for r, k, _ in long) == [("length", 1500)] * 2
    c = groups.counters
    assert c.groups_formed == 1 and c.restores == 1
    (event,) = [e for e in c.events if e["event"] == "restore"]
    assert (event["prefetched"], event["source"]) == (False, source)
    x = _check_bytes(groups, event, long)
    assert sum(x["at"]) > 0 and x["stall"] > 0  # live requests' KV and every weight moved then
    # the long requests were decoding at the restore: their tokens stop for the copies
    gaps = [max(b - a for a, b in zip(t.token_times, t.token_times[1:])) for _, _, t in long]
    assert min(gaps) >= x["stall"]


def test_from_the_host_the_weights_leave_the_pipeline_link(tmp_path):
    _, _, peer = _run(tmp_path, "off", "peer")
    _, _, host = _run(tmp_path, "off", "host")
    (p,) = [e for e in peer.counters.events if e["event"] == "restore"]
    (h,) = [e for e in host.counters.events if e["event"] == "restore"]
    # the same bytes; the host's 32 GB/s beats the pipeline link's 7.83 GB/s for the weights
    assert p["weight_bytes"] == h["weight_bytes"] > 0
    assert h["stall_s"] < p["stall_s"]


@pytest.mark.parametrize("source", ["peer", "host"])
def test_prefetched_the_full_blocks_move_before_the_step_and_the_last_ones_at_it(tmp_path,
                                                                                 source):
    ends, long, groups = _run(tmp_path, "on", source)
    assert sorted({(r, k) for r, k, _ in ends}) == [("length", 200)] and len(ends) == 40
    assert sorted((r, k) for r, k, _ in long) == [("length", 1500)] * 2
    (event,) = [e for e in groups.counters.events if e["event"] == "restore"]
    assert (event["prefetched"], event["source"]) == (True, source)
    x = _check_bytes(groups, event, long)
    assert sum(x["before"]) > 0
    net = groups.instances[event["members"][0]].engine.backend.runner.network
    # the pipeline link carried the full blocks' KV while the group served, and the weights
    # too from peers (from the host they took the host link)
    weights = sum(x["weights"]) if source == "peer" else 0
    assert sum(xc.sent_bytes for xc in net.exchanges) == sum(x["before"]) + weights
    if source == "host":  # as long as the slower of the host copies and the KV on the link
        assert event["restore_s"] >= max(w / groups.host_bytes_per_s for w in x["weights"])


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
