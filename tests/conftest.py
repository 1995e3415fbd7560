"""Shared fixtures. Tests build their own tiny models; nothing is downloaded."""

from __future__ import annotations

import os

# Triton kernels run on the CPU through the interpreter; it must be chosen before triton loads.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest


def slow_scale(full: int, short: int) -> int:
    """Size of a slow case: `full` when SHUNTER_SLOW=1, else the shorter form CI runs."""
    return full if os.environ.get("SHUNTER_SLOW") == "1" else short


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory):
    from gpu.make_model import write_random_model

    out = tmp_path_factory.mktemp("tiny-llama")
    write_random_model(out, arch="llama", layers=2, hidden=64, heads=4, kv_heads=2,
                       vocab=320, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory):
    from gpu.make_model import write_random_model

    out = tmp_path_factory.mktemp("tiny-qwen2")
    write_random_model(out, arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2,
                       vocab=320, seed=1)
    return out


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every `@pytest.mark.anyio` test runs under both event loops."""
    return request.param


# session-scoped process setups of the cluster tests (registered here so every test sees them)
from tests.cluster_fixtures import (  # noqa: E402,F401
    cluster_config,
    local_instances,
    local_launcher,
    pipeline_group,
    ray_cluster,
    ray_instances,
)
