"""Issue 14: RT decodes must not lose iterations to prompt chunks. BROS §4.1 bounds a batch by
B requests and the predicted iteration time, never by tokens; on an engine with a token budget
a prompt chunk that took all of it left every decode behind it out of the iteration (at 12 RT/s
on 3,500 blocks with 256 sequences: 34,256 RT decode-steps, 9.5% of those RT requests' steps).
A prompt chunk now leaves a token for each decode of its class."""

from __future__ import annotations

from bisect import bisect_left

from engine.config import EngineConfig
from policies import policy_path
from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.run import run_one
from shunter.workloads import RequestSpec, Workload


def workload() -> Workload:
    """4 RT requests decoding 120 tokens, and RT prompts of 700 tokens (two chunks of a
    512-token budget) arriving every 0.25 s while they decode."""
    specs = [RequestSpec(index=i, arrival_s=0.0, prompt_tokens=40, output_tokens=120,
                         ttft_ms=400.0, tpot_ms=200.0) for i in range(4)]
    specs += [RequestSpec(index=4 + k, arrival_s=0.3 + 0.25 * k, prompt_tokens=700,
                          output_tokens=2, ttft_ms=400.0, tpot_ms=200.0) for k in range(8)]
    return Workload(name="decodes", description="RT decodes beside long RT prompts", params={},
                    requests=tuple(specs), duration_s=3.0)


def test_rt_decodes_run_every_iteration_beside_prompt_chunks() -> None:
    w = workload()
    run = run_one(PolicyChoice(label="bros", path=policy_path("bros")), w,
                  EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=3500),
                  progress=False, clock_limit_s=60.0)
    assert run.error is None, run.error
    planned = list(run.log.time)
    decoders = [t for t in run.drive.timelines if len(t.token_times) == 120]
    assert len(decoders) == 4
    prompts_done = [t for t in run.drive.timelines if len(t.token_times) == 2]
    assert len(prompts_done) == 8
    for t in decoders:
        # iterations planned between its first and last token: one per later token when it
        # decodes in every one (each token lands when its iteration ends, before the next plan)
        spanned = bisect_left(planned, t.token_times[-1]) - bisect_left(planned, t.token_times[0])
        assert spanned - (len(t.token_times) - 1) <= 1, (t.request_id, spanned)
