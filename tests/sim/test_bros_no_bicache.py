"""`bros_no_bicache` is BROS §7.4.1's ablation without the bidirectional cache: "we simply
perform recomputation for requests failing to acquire cache blocks". An RT request that lacks
its next block is itself preempted by recompute (`preempt ... short_of_block = self`), where
bros_no_bicache_below (round 10's shipped ablation) evicts the BE request ranked below it."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from policies import policy_path
from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.run import run_one
from shunter.workloads import RequestSpec, Workload

BELOW = Path(__file__).resolve().parents[2] / "bench" / "bros_no_bicache_below.policy"


def workload() -> Workload:
    """An RT and a BE request of 40 + 100 tokens at once in 10 blocks of 16 slots: each ends
    in 9 blocks, so after 80 output tokens (5 blocks each, the pool full) one must go."""
    specs = [RequestSpec(index=0, arrival_s=0.0, prompt_tokens=40, output_tokens=100,
                         request_class="rt", ttft_ms=400.0, tpot_ms=200.0),
             RequestSpec(index=1, arrival_s=0.0, prompt_tokens=40, output_tokens=100,
                         request_class="be")]
    return Workload(name="short", description="an RT request short of a block", params={},
                    requests=tuple(specs), duration_s=1.0)


def run(path: Path) -> dict:
    out = run_one(PolicyChoice(label=path.stem, path=path), workload(),
                  EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=10,
                               block_size=16), progress=False, clock_limit_s=60.0)
    assert out.error is None, out.error
    by_class = {t.request_class: t for t in out.drive.timelines}
    assert sorted(by_class) == ["be", "rt"]
    assert all(len(t.token_times) == 100 for t in by_class.values())  # both end
    return by_class


def test_the_ablation_recomputes_the_rt_request_that_lacks_a_block() -> None:
    # it comes back by displacing the BE request (`displace`, BROS Fig. 5 case 2)
    by_class = run(policy_path("bros_no_bicache"))
    assert by_class["rt"].preemptions >= 1, {c: t.preemptions for c, t in by_class.items()}


def test_below_evicts_the_be_request_instead() -> None:
    by_class = run(BELOW)
    assert (by_class["rt"].preemptions, by_class["be"].preemptions >= 1) == (0, True), \
        {c: t.preemptions for c, t in by_class.items()}
