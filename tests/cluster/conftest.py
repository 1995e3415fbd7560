"""Shared by the KunServe torch cluster tests (test_kunserve_torch_*.py): one tiny model for
the session, so transformers' reference outputs (tests/reference.py caches them by model
directory) are computed once, and the instances' configuration."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def kunserve_model(tmp_path_factory):
    from gpu.make_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("kunserve-cluster-4l"), arch="llama",
                              layers=4, hidden=64, heads=4, kv_heads=2, vocab=320, seed=7)


@pytest.fixture(scope="session")
def kunserve_config(kunserve_model, tmp_path_factory):
    """Instances of the tiny model with 24-block pools of 4 tokens, policy `kunserve_lookahead`
    with a one-round drop and a restore at 60%."""
    from engine.config import EngineConfig
    from policies import policy_path

    policy = tmp_path_factory.mktemp("kunserve-policy") / "kunserve_torch.policy"
    # the shipped drop rule waits two monitor rounds; one is enough here (a burst on this tiny
    # model can drain within two 20 ms rounds on a fast run)
    policy.write_text(f'policy kunserve_torch extends "{policy_path("kunserve_lookahead")}" {{\n'
                      f'  overload drop when head_tokens > free_tokens\n'
                      f'  overload restore when kv_usage < 60%\n}}\n')
    return EngineConfig(model=kunserve_model, device="cpu", threads=1, num_blocks=24,
                        block_size=4, cpu_swap_blocks=0, max_num_seqs=32, policy=policy)
