"""KunServe groups over instances on different Ray nodes: a Ray cluster of a head (no CPU for
instances) and two worker nodes of one CPU each (`ray.cluster_utils.Cluster`), so Ray has to
place the two instance actors on different nodes. The data plane meets at instance 0's node
address (not loopback) and every instance's gloo listens on the address it reaches that node
from (gpu/data_plane.py `route_address`), not on what the host name resolves to. The burst
forms a group across the nodes, exchanges KV, restores, and every request gives transformers'
tokens.

Honest limit: the nodes are several raylets on this one machine, so they share its address;
this does not show that packets cross machines (Ray's own multi-node test setup, not several
machines). The Ray cluster is the session's (tests/cluster_fixtures.py `ray_cluster`), shared
with tests/cluster/test_ray.py.
"""

from __future__ import annotations

import random

import anyio
import pytest

from shunter.cluster.cluster import Cluster
from tests.cluster.test_kunserve_torch_cluster import (BURST_TOKENS, LONG_TOKENS, _long_then_burst,
                                                    _prompt)
from tests.reference import assert_matches, greedy_reference


@pytest.mark.anyio
async def test_a_group_forms_across_ray_nodes_with_transformers_outputs(
        anyio_backend, ray_cluster, kunserve_config, kunserve_model):
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    from shunter.cluster.launch import RayLauncher

    launcher = RayLauncher()
    rng = random.Random(0)
    longs = [_prompt(rng, 8) for _ in range(2)]
    burst = [_prompt(rng, 16) for _ in range(12)]
    got: dict[str, list[int]] = {}
    try:
        instances = [launcher.start_actor(i, kunserve_config) for i in range(2)]
        nodes = [up.node for up in instances]
        assert len(set(nodes)) == 2 and "" not in nodes, nodes
        hosts = [up.host for up in instances]
        assert "127.0.0.1" not in hosts, hosts
        async with Cluster.start(kunserve_config, attach=instances,
                                 monitor_interval_s=0.02) as cluster:
            with anyio.fail_after(300):
                await _long_then_burst(cluster, longs, burst, got, {})
                await cluster.wait_idle()
                while cluster.groups.groups or cluster.groups.busy:  # the idle group restores
                    await anyio.sleep(0.01)
            report = cluster.groups.report(0.0)
    finally:
        launcher.shutdown()
    print(f"\nray nodes {nodes}, hosts {hosts}; {report}")
    assert report["groups_formed"] >= 1 and report["kv_exchanged_bytes"] > 0, report
    assert report["restores"] >= 1, report
    for name, prompt, n in [*((f"L{i}", p, LONG_TOKENS) for i, p in enumerate(longs)),
                            *((f"B{i}", p, BURST_TOKENS) for i, p in enumerate(burst))]:
        assert_matches(got[name], greedy_reference(kunserve_model, prompt, n), name)
