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
def ray_instances(cluster_config):
    """A local Ray (`ray.init(num_cpus=2)`, once per session) with two instance actors. Slow
    (Ray's own start-up on 2 cores), so only with SHUNTER_SLOW=1 or SHUNTER_RAY=1."""
    import os

    if os.environ.get("SHUNTER_SLOW") != "1" and os.environ.get("SHUNTER_RAY") != "1":
        pytest.skip("Ray cluster tests run with SHUNTER_SLOW=1 or SHUNTER_RAY=1 (Ray's start-up "
                    "alone takes longer than CI allows for them)")
    ray = pytest.importorskip("ray", reason="Ray is the cluster extra: pip install -e '.[cluster]'")
    from shunter.cluster.launch import RayLauncher

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    launcher = RayLauncher()
    try:
        yield [launcher.start_actor(i, cluster_config) for i in range(2)]
    finally:
        launcher.shutdown()
        ray.shutdown()
