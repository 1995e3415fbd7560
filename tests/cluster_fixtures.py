"""Session-scoped process setups shared by the cluster tests: each spawns processes that import
torch (seconds each on 2 cores), so every test that needs one shares it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def pipeline_group(tiny_llama_dir):
    """Two stage processes of the tiny Llama (one layer each), joined over gloo."""
    from engine.config import EngineConfig
    from gpu.config import ModelConfig
    from gpu.pipeline import PipelineGroup

    config = EngineConfig(model=tiny_llama_dir, device="cpu", threads=1, pipeline_stages=2,
                          num_blocks=64, cpu_swap_blocks=0)
    group = PipelineGroup(config, ModelConfig.from_dir(tiny_llama_dir), 64, stages=2,
                          microbatches=4)
    group.start()
    yield group
    group.stop()


@pytest.fixture(scope="session")
def cluster_config(tiny_llama_dir):
    from engine.config import EngineConfig

    return EngineConfig(model=tiny_llama_dir, device="cpu", threads=1, num_blocks=64,
                        cpu_swap_blocks=0, max_num_seqs=32)


@pytest.fixture(scope="session")
def local_launcher():
    from shunter.cluster.launch import LocalLauncher

    launcher = LocalLauncher("asyncio")
    yield launcher
    launcher.shutdown(timeout_s=0)


@pytest.fixture(scope="session")
def local_instances(cluster_config, local_launcher):
    """Two instance processes of the tiny Llama, started once; each test attaches its own
    cluster (coordinator, links) to them from its own event loop and detaches at the end."""
    return [local_launcher.start_process(i, cluster_config) for i in range(2)]


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray for every Ray test of the session: a head with no CPUs and two worker nodes of
    one CPU each (each its own raylet, so instances land on distinct nodes), connected with
    `ray.init(address=...)`. Each test's actors take one CPU and are killed when the test (or
    its module) ends, so the next one finds both nodes free. Skipped without Ray (the
    `cluster` extra, which CI installs) or with SHUNTER_RAY=0."""
    import os

    if os.environ.get("SHUNTER_RAY") == "0":
        pytest.skip("SHUNTER_RAY=0: Ray tests off")
    ray = pytest.importorskip("ray", reason="Ray is the cluster extra: pip install -e '.[cluster]'")
    if ray.is_initialized():
        pytest.skip("this process is connected to another Ray already")
    from ray.cluster_utils import Cluster as RayCluster

    nodes = RayCluster(initialize_head=True,
                       head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(2):
            nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, log_to_driver=False)
        yield ray
    finally:
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture(scope="module")
def ray_instances(cluster_config, ray_cluster):
    """Two instance actors of the tiny Llama on the session's Ray, for one module."""
    from shunter.cluster.launch import RayLauncher

    launcher = RayLauncher()
    try:
        yield [launcher.start_actor(i, cluster_config) for i in range(2)]
    finally:
        launcher.shutdown()
