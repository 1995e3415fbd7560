"""`shunter serve --instances N`: one HTTP server fronts the cluster; /metrics labels each
instance's engine-side metrics with `instance`, /admin/stats reports every instance, and a
policy PUT reaches every instance and the coordinator's dispatch rule."""

from __future__ import annotations

import anyio
import httpx
import pytest

from shunter.cluster.cluster import Cluster
from shunter.server import build_app
from tests.http_serving import serving_app
from tests.reference import assert_matches, greedy_reference


@pytest.mark.anyio
async def test_one_server_fronts_the_cluster(cluster_config, local_instances, tiny_llama_dir):
    async with Cluster.start(cluster_config, attach=local_instances) as cluster:
        async with (serving_app(build_app(cluster, None)) as url,
                    httpx.AsyncClient(base_url=url, timeout=60) as http):
            prompts = [[11, 12, 13], [40, 41], [7, 8, 9, 10]]
            for prompt in prompts:  # one at a time: round robin alternates
                r = await http.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": 5, "temperature": 0,
                    "return_token_ids": True})
                assert r.status_code == 200, r.text
                tokens = r.json()["choices"][0]["token_ids"]
                assert_matches(tokens, greedy_reference(tiny_llama_dir, prompt, 5), str(prompt))
            metrics = (await http.get("/metrics")).text
            for i in (0, 1):
                assert f'shunter:num_requests_running{{instance="{i}",model_name=' in metrics
                assert f'shunter:instance_up{{instance="{i}",model_name=' in metrics
            assert metrics.count("shunter:policy_info{") == 1
            stats = (await http.get("/admin/stats")).json()["instances"]
            assert [s["instance"] for s in stats] == [0, 1]
            assert all(s["alive"] and s["scheduler"]["total_blocks"] == 64 for s in stats)
            assert sum(s["dispatch"]["in_flight"] for s in stats) == 0
            r = await http.put("/admin/policy", content="policy lb { dispatch least_load }")
            assert r.status_code == 200, r.text
            assert cluster.policy.settings.dispatch == "least_load"
            stats = (await http.get("/admin/stats")).json()["instances"]
            assert [s["scheduler"]["policy"] for s in stats] == ["lb", "lb"]
            # least_load sends requests that never overlap to the lowest index (ties),
            # where round robin alternated
            before = [cluster.table.dispatched_to(i) for i in (0, 1)]
            for prompt in prompts[:2]:
                r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                assert r.status_code == 200, r.text
            after = [cluster.table.dispatched_to(i) for i in (0, 1)]
            assert [a - b for a, b in zip(after, before)] == [2, 0]
            bad = await http.put("/admin/policy", content="policy x { dispatch fastest }")
            assert bad.status_code == 400
            assert "unknown dispatch rule 'fastest'" in bad.json()["error"]["message"]
        # back to the policy the other tests sharing these instances expect
        await cluster.replace_policy("policy fcfs { }")


def _cancelled(snap) -> int:
    return sum(n for s in snap.snapshots for _, n in s.scheduler.cancelled_by_state)


@pytest.mark.anyio
async def test_a_client_hanging_up_cancels_its_request_on_the_instance(cluster_config,
                                                                       local_instances):
    """Each instance's engine counts the cancel, and every block is free again (a request not
    cancelled there would run its 900 tokens and end `length`, counted as no cancel)."""
    async with Cluster.start(cluster_config, attach=local_instances) as cluster:
        before = _cancelled(await cluster.wait_idle())
        async with (serving_app(build_app(cluster, None)) as url,
                    httpx.AsyncClient(base_url=url, timeout=60) as http):
            body = {"prompt": [11, 12, 13], "max_tokens": 900, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}
            for _ in range(2):  # round robin: one to each instance
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    assert (await r.aiter_lines().__anext__()).startswith("data: {")
        with anyio.fail_after(60):
            snap = await cluster.wait_idle()
    assert _cancelled(snap) - before == 2
    assert [s.allocator.allocated_blocks for s in snap.snapshots] == [0, 0]
