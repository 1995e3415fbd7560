"""The simulator can charge the scheduler's own CPU time to its virtual clock (issue 14, item
10): with it, each busy iteration lasts the predicted step plus the planning it measured."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import ConfigError
from policies import policy_path
from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.run import run_one
from shunter.workloads import BatchSource, Workload

WORKLOAD = Workload(name="be", description="", params={}, requests=(), duration_s=0.0,
                    batches=(BatchSource(batch_size=8, max_batches=3, prompt_range=(64, 256),
                                         output_range=(8, 32)),))


def excess(log, charge: bool) -> list[float]:
    """Per busy iteration: time until the next one starts, less its predicted step and (when
    charged) its planning time; 0 unless the scheduler then idled (between BE batches)."""
    busy = [i for i in range(len(log)) if log.batch_seqs[i]]
    assert len(busy) == len(log.predictions)
    return [log.time[i + 1] - log.time[i] - p / 1000.0 - (log.scheduler_s[i] if charge else 0.0)
            for i, (p, _) in zip(busy, log.predictions) if i + 1 < len(log)]


@pytest.mark.parametrize("charge", [False, True])
def test_planning_time_passes_on_the_virtual_clock_only_when_charged(charge):
    base = EngineConfig(backend="sim", num_blocks=400, charge_scheduler_time=charge)
    run = run_one(PolicyChoice(label="bros", path=policy_path("bros")), WORKLOAD, base,
                  progress=False)
    extra = excess(run.log, charge)
    assert sum(abs(e) < 1e-9 for e in extra) >= len(extra) - 3  # 2 idle waits between batches
    assert min(extra) > -1e-9
    assert 0 < run.metrics.scheduler_share < 1
    # the sim's steps take what the model predicts; charged, the iteration also plans
    assert (run.metrics.cost_model_error["median"] > 1e-6) is charge


def test_only_the_simulator_charges_planning_time():
    with pytest.raises(ConfigError, match="charge_scheduler_time is for the sim backend"):
        EngineConfig(backend="torch", charge_scheduler_time=True)
