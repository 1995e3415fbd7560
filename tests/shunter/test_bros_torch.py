"""The torch backend gives packing policies a prediction too (issue 14, item 1): a cost model
fitted in the engine from its own iterations, not a moving average, with its error reported."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.cost_model import BatchShape, CostModel
from engine.errors import ConfigError
from policies import policy_path
from shunter.benchmark.policies import PolicyChoice
from shunter.backends import build_backend
from shunter.benchmark.run import run_one
from shunter.workloads import BatchSource, RequestSpec, Workload
from sim.profile import CopyLink, ModelShape, Profile, save_profile


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


def _profile(path, layers: int):
    """A profile of the tiny Llama's shape (or one with `layers` instead) and a known model."""
    shape = ModelShape(name="tiny", num_layers=layers, hidden_size=64, intermediate_size=128,
                       num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=320)
    cost = CostModel(a_ms=3.0, b_ms_per_prefill_token=0.25, c_ms_per_prefill_token_sq=0.0,
                     d_ms_per_decode_seq=0.5, e_ms_per_decode_context_token=0.01)
    save_profile(Profile(name="tiny", model=shape, gpu="cpu", gpu_memory_gib=1.0, cost=cost,
                         link=CopyLink(bandwidth_gb_per_s=5.0, dispatch_us=10.0), source="test"),
                 path)
    return cost


def test_the_torch_backend_predicts_with_a_fitted_profile_file(tiny_llama_dir, tmp_path):
    """Issue 14, item 1: `cost_profile` (a `shunter profile fit` file) gives the torch backend
    the profile's cost model from the first iteration, with its copy link; no online fit."""
    cost = _profile(tmp_path / "p.json", layers=2)
    backend = build_backend(EngineConfig(model=tiny_llama_dir, device="cpu", dtype="float32",
                                         num_blocks=16, block_size=4,
                                         cost_profile=str(tmp_path / "p.json")))
    model = backend.cost_model
    assert model is not None and model.copy is not None and model.copy.dispatch_us == 10.0
    shape = BatchShape.of([(0, 20), (7, 1)])
    assert model.predict_ms(shape) == pytest.approx(cost.predict_ms(shape))
    base = EngineConfig(model=tiny_llama_dir, device="cpu", dtype="float32", threads=1,
                        num_blocks=64, block_size=4, max_num_seqs=8, max_batched_tokens=64,
                        cost_profile=str(tmp_path / "p.json"))
    rt = tuple(RequestSpec(index=i, arrival_s=0.05 * i, prompt_tokens=12 + i, output_tokens=4,
                           ttft_ms=400.0, tpot_ms=200.0) for i in range(3))
    run = run_one(PolicyChoice(label="bros_no_bicache", path=policy_path("bros_no_bicache")),
                  Workload(name="rt", description="", params={}, requests=rt, duration_s=0.2),
                  base, progress=False)
    assert run.error is None and run.metrics.failed == 0
    busy = sum(1 for n in run.log.batch_seqs if n)
    assert len(run.log.predictions) == busy, "every iteration with work is predicted at once"


def test_a_profile_of_another_model_or_on_the_sim_is_refused(tiny_llama_dir, tmp_path):
    _profile(tmp_path / "p.json", layers=3)
    with pytest.raises(ConfigError, match=r"fitted for tiny \(3 layers, hidden 64, 2 KV heads "
                                          r"of 16\), not for .* \(2 layers"):
        build_backend(EngineConfig(model=tiny_llama_dir, device="cpu", num_blocks=16,
                                   cost_profile=str(tmp_path / "p.json")))
    with pytest.raises(ConfigError, match="cost_profile is for the torch backend"):
        EngineConfig(backend="sim", cost_profile=str(tmp_path / "p.json"))
