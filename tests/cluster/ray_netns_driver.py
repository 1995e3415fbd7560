"""The front door of test_kunserve_torch_ray_netns.py, run on the Ray head's host (a network
namespace: `ip netns exec HOST python -m tests.cluster.ray_netns_driver CONFIG RAY_ADDRESS`):
connects to the Ray cluster there, starts two instance actors through `RayLauncher` (one CPU
each, one CPU per node: Ray puts one on each host), runs the KunServe burst of
test_kunserve_torch_cluster.py, and prints one JSON line: each instance's host, Ray node, pid and
established TCP links, the group report, every request's tokens."""

from __future__ import annotations

import json
import pickle
import random
import sys

import anyio


async def _serve(config, instances) -> dict:
    from shunter.cluster.cluster import Cluster
    from tests.cluster.test_kunserve_torch_cluster import _long_then_burst, _prompt
    from tests.cluster.test_kunserve_torch_netns import tcp_connections

    rng = random.Random(0)
    longs = [_prompt(rng, 8) for _ in range(2)]
    burst = [_prompt(rng, 16) for _ in range(12)]
    got: dict[str, list[int]] = {}
    async with Cluster.start(config, attach=instances, monitor_interval_s=0.02) as cluster:
        with anyio.fail_after(300):
            await _long_then_burst(cluster, longs, burst, got, {})
            await cluster.wait_idle()
            while cluster.groups.groups or cluster.groups.busy:  # the idle group restores
                await anyio.sleep(0.01)
        report = cluster.groups.report(0.0)
        links = [tcp_connections(up.pid) for up in instances]
    return {"hosts": [up.host for up in instances], "nodes": [up.node for up in instances],
            "pids": [up.pid for up in instances], "links": links, "report": report,
            "got": got, "longs": longs, "burst": burst}


def main(config_path: str, address: str) -> None:
    import ray

    from shunter.cluster.launch import RayLauncher

    with open(config_path, "rb") as f:
        config = pickle.load(f)
    ray.init(address=address, log_to_driver=False)
    launcher = RayLauncher()
    try:
        instances = [launcher.start_actor(i, config) for i in range(2)]
        out = anyio.run(_serve, config, instances)
    finally:
        launcher.shutdown()
        ray.shutdown()
    print("RESULT " + json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
