"""Issue 14: with its bidirectional cache, `bros` never finished on a small KV pool (the torch
bench's 96 blocks): every block held by BE requests, each waiting for a wholly free block (to
grow, or to swap its checkpointed slots back), packing skipped them all, the batch stayed empty
and the scheduler idled forever. A BE request short of free blocks now goes first when nothing
else runs, and its step swaps the others out (§5.2's extreme case)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from policies import policy_path
from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.run import run_one
from shunter.workloads import load_workload


@pytest.mark.parametrize("seed", range(6))
def test_bros_finishes_on_a_pool_its_be_requests_fill(seed: int) -> None:
    workload = load_workload(f"rtbe:rate=1,duration=5,seed={seed},scale_lengths=0.25")
    config = EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=96,
                          max_num_seqs=64, max_batched_tokens=256, max_queued_requests=100_000)
    run = run_one(PolicyChoice(label="bros", path=policy_path("bros")), workload, config,
                  progress=False, clock_limit_s=20 * workload.duration_s)
    assert run.error is None, run.error  # "did not finish within 100.0 s of engine clock"
    assert run.metrics.failed == 0 and not run.drive.failed
    assert len(run.drive.timelines) == len(run.drive.goals) > 0  # every request answered
