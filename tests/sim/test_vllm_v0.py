"""`policies/vllm_v0.policy` on the simulator: vLLM V0's scheduler (`prefill separate`), the
vLLM that BROS §7 compares with. Every plan the engine makes is recorded: no iteration mixes
prompts and decodes, a waiting prompt takes the next iteration from the decodes, and a prompt
that fits the policy's 2,048-token budget runs whole (the engine's own budget is 512). fcfs on
the same arrivals mixes them, so the recording can tell the two apart."""

from __future__ import annotations

import pytest

import actors.scheduler
from engine.config import EngineConfig
from engine.planner import plan_iteration
from policies import policy_path
from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.run import run_one
from shunter.workloads import RequestSpec, Workload


def workload() -> Workload:
    """4 requests decoding 200 tokens, and 700-token prompts arriving every 0.25 s beside them."""
    specs = [RequestSpec(index=i, arrival_s=0.0, prompt_tokens=40, output_tokens=200)
             for i in range(4)]
    specs += [RequestSpec(index=4 + k, arrival_s=0.2 + 0.25 * k, prompt_tokens=700,
                          output_tokens=2) for k in range(6)]
    return Workload(name="phases", description="decodes beside long prompts", params={},
                    requests=tuple(specs), duration_s=2.0)


def plans(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[dict, dict]]:
    """(work, the requests the plan was made from, by id) for every plan of a run of `name`."""
    seen: list[tuple[dict, dict]] = []

    def recording(decision, requests, budget):
        plan = plan_iteration(decision, requests, budget)
        seen.append((dict(plan.work), {r.id: r for r in requests}))
        return plan

    monkeypatch.setattr(actors.scheduler, "plan_iteration", recording)
    run = run_one(PolicyChoice(label=name, path=policy_path(name)), workload(),
                  EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=3500),
                  progress=False, clock_limit_s=60.0)
    assert run.error is None, run.error
    assert len(run.drive.timelines) == 10
    return seen


def phases(work: dict, views: dict) -> tuple[set[int], set[int]]:
    """(prompt work, decodes): a decode computes the one token its last sample added."""
    decodes = {i for i in work if views[i].output_tokens and views[i].remaining_tokens == 1}
    return set(work) - decodes, decodes


def test_vllm_v0_runs_whole_prompts_alone_and_decodes_otherwise(monkeypatch) -> None:
    seen = plans(monkeypatch, "vllm_v0")
    decoding = prompted = 0
    for work, views in seen:
        prompts, decodes = phases(work, views)
        assert not (prompts and decodes), work
        waiting = {i for i, r in views.items() if r.state == "waiting"}
        if waiting:  # the pool is ample: every waiting prompt fits, and takes the iteration
            assert set(work) == waiting, (work, waiting)
            prompted += 1
        for i in prompts:
            assert work[i] == views[i].remaining_tokens  # whole, beyond the engine's 512
        decoding += bool(decodes)
    assert prompted >= 6 and decoding > 100


def test_fcfs_mixes_them_on_the_same_arrivals(monkeypatch) -> None:
    mixed = [w for w, v in plans(monkeypatch, "fcfs") if all(phases(w, v))]
    assert len(mixed) >= 6
