"""The same cluster through Ray (`--cluster ray`): instances are Ray actors on the session's
local Ray of two worker nodes (tests/cluster_fixtures.py `ray_cluster`)."""

from __future__ import annotations

import pytest

from shunter.cluster.cluster import Cluster
from tests.cluster.prompts import MAX_TOKENS, PROMPTS
from tests.cluster.test_cluster import _complete_all
from tests.reference import assert_matches, greedy_reference


@pytest.mark.anyio
async def test_two_ray_instances_serve_32_prompts_like_transformers(cluster_config, ray_instances,
                                                                     tiny_llama_dir):
    async with Cluster.start(cluster_config, attach=ray_instances) as cluster:
        got = await _complete_all(cluster, PROMPTS, MAX_TOKENS)
        snap = await cluster.wait_idle()
    for i, tokens in enumerate(got):
        assert_matches(tokens, greedy_reference(tiny_llama_dir, PROMPTS[i], MAX_TOKENS),
                       f"prompt {i}")
    assert [cluster.table.dispatched_to(i) for i in range(2)] == [16, 16]
    assert all(s is not None for s in snap.snapshots)
    assert len({i.pid for i in cluster.instances}) == 2
