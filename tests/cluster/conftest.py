"""Shared by the KunServe torch cluster tests (test_kunserve_torch_cluster.py,
test_kunserve_torch_faults.py): one tiny model for the session, so transformers' reference
outputs (tests/reference.py caches them by model directory) are computed once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def kunserve_model(tmp_path_factory):
    from gpu.make_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("kunserve-cluster-4l"), arch="llama",
                              layers=4, hidden=64, heads=4, kv_heads=2, vocab=320, seed=7)
