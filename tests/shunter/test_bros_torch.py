"""The torch backend gives packing policies a prediction too (issue 14, item 1): a cost model
fitted in the engine from its own iterations, not a moving average, with its error reported."""

from __future__ import annotations

from engine.config import EngineConfig
from policies import policy_path
from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.run import run_one
from shunter.workloads import BatchSource, RequestSpec, Workload


def test_bros_on_the_torch_backend_predicts_with_a_fitted_model(tiny_llama_dir):
    rt = tuple(RequestSpec(index=i, arrival_s=0.05 * i, prompt_tokens=12 + i, output_tokens=6,
                           ttft_ms=400.0, tpot_ms=200.0) for i in range(6))
    workload = Workload(name="rtbe", description="", params={}, requests=rt, duration_s=0.3,
                        batches=(BatchSource(batch_size=6, max_batches=2, prompt_range=(8, 40),
                                             output_range=(4, 12)),))
    base = EngineConfig(model=tiny_llama_dir, device="cpu", dtype="float32", threads=1,
                        num_blocks=64, block_size=4, max_num_seqs=8, max_batched_tokens=64)
    run = run_one(PolicyChoice(label="bros_no_bicache", path=policy_path("bros_no_bicache")),
                  workload, base, progress=False)
    assert run.error is None and run.metrics.failed == 0
    error = run.metrics.cost_model_error
    # the first 8 iterations with work teach the model; every later one is predicted
    busy = sum(1 for n in run.log.batch_seqs if n)
    assert error is not None and error["iterations"] == len(run.log.predictions) >= busy - 8
    assert set(run.metrics.by_class) == {"rt", "be"}
