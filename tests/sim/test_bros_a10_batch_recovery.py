"""Issue 14, round 10e: on the Llama-3-8B A10 profile (2,300 blocks, 2,048-token batches) at
5 RT/s, a long RT prompt that does not fit the tightest TPOT budget is a predicted violation,
which resets bros's adaptive batch size to its start of 8 (BROS §4.2). Growing back by 1 an
iteration left the cap below the 55-64 running RT decodes for ~50 iterations, so RT decodes and
every BE request were left out, and the next reset came first: BE 0.45-0.60x fcfs. Growing by 8
(policies/bros.policy) it is 0.82-0.92x for seeds 9 and 1 (seed 2 stays at 0.50x, short of
memory; bench/results/bros_round10e_a10_be.md). Simulator, uncharged virtual time."""

from __future__ import annotations

from engine.config import EngineConfig
from policies import policy_path
from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.run import run_one
from shunter.workloads import load_workload

MIN_BE_SHARE = 0.72
"""bros's BE requests/s over fcfs's on these arrivals: 0.82 with +8, about 0.59-0.60 with +1
(a script and pytest gave 0.821-0.828 and 0.590-0.599 until f157d75 pinned trio's order of
same-instant tasks in every sim run; both give the script's now). 60 s runs do not tell the two
apart (1.13 and 1.18 x fcfs): the first resets come late, so the test runs the full 120 s."""


def test_bros_batch_size_recovers_from_a_reset_before_be_starves() -> None:
    duration = 120
    workload = load_workload(f"rtbe:rate=5,duration={duration},seed=1")
    config = EngineConfig(backend="sim", profile="llama3-8b-a10", num_blocks=2300,
                          max_batched_tokens=2048, max_num_seqs=256,
                          max_queued_requests=100_000)
    be = {}
    for name in ("fcfs", "bros"):
        out = run_one(PolicyChoice(label=name, path=policy_path(name)), workload, config,
                      progress=False, clock_limit_s=20 * duration)
        assert out.error is None, out.error
        be[name] = out.metrics.by_class["be"]["requests_per_s"]
    assert be["bros"] >= MIN_BE_SHARE * be["fcfs"], be
