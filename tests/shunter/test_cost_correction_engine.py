"""The online cost-model correction in a running engine (issue 14 item 1, the error under load):
on the torch backend the policy is told the profile's prediction times the running median of
measured / predicted per phase, the log keeps the raw prediction beside it and the bench JSON
reports both errors; the simulator never corrects. No assertion here depends on how long a step
took: the corrected predictions are replayed from the log's own measured times."""

from __future__ import annotations

import attrs
import pytest

from engine.config import EngineConfig
from engine.cost_model import CostModel
from engine.cost_model_correction import Correction
from engine.errors import ConfigError
from policies import policy_path
from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.run import run_one
from shunter.workloads import BatchSource, RequestSpec, Workload
from sim.profile import CopyLink, ModelShape, Profile, save_profile

BROS = PolicyChoice(label="bros_no_bicache", path=policy_path("bros_no_bicache"))


def _workload() -> Workload:
    rt = tuple(RequestSpec(index=i, arrival_s=0.04 * i, prompt_tokens=12 + i, output_tokens=6,
                           ttft_ms=400.0, tpot_ms=200.0) for i in range(5))
    return Workload(name="rtbe", description="", params={}, requests=rt, duration_s=0.3,
                    batches=(BatchSource(batch_size=4, max_batches=2, prompt_range=(8, 30),
                                         output_range=(4, 10)),))


def _stale_profile(path) -> None:
    """The tiny Llama's shape with a model far off this machine's speed (a stale profile)."""
    shape = ModelShape(name="tiny", num_layers=2, hidden_size=64, intermediate_size=128,
                       num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=320)
    cost = CostModel(a_ms=0.01, b_ms_per_prefill_token=1e-4, c_ms_per_prefill_token_sq=0.0,
                     d_ms_per_decode_seq=1e-4, e_ms_per_decode_context_token=1e-6)
    save_profile(Profile(name="tiny", model=shape, gpu="cpu", gpu_memory_gib=1.0, cost=cost,
                         link=CopyLink(bandwidth_gb_per_s=5.0, dispatch_us=10.0), source="test"),
                 path)


@pytest.mark.parametrize("window", [16, 0])
def test_the_torch_backend_corrects_a_stale_profile_by_the_times_it_measures(
        tiny_llama_dir, tmp_path, window):
    _stale_profile(tmp_path / "p.json")
    base = EngineConfig(model=tiny_llama_dir, device="cpu", dtype="float32", threads=1,
                        num_blocks=64, block_size=4, max_num_seqs=8, max_batched_tokens=64,
                        cost_profile=str(tmp_path / "p.json"), cost_correction=window)
    run = run_one(BROS, _workload(), base, progress=False)
    assert run.error is None and run.metrics.failed == 0
    log, error = run.log, run.metrics.cost_model_error
    assert len(log.raw_predictions) == len(log.predictions) == error["iterations"] > 8
    assert "raw_median" in error
    # replay: each prediction the policy was told is the raw one times the correction of the
    # steps measured before it (one step in flight at a time on one torch process)
    busy = [i for i, n in enumerate(log.batch_seqs) if n]
    assert len(busy) == len(log.predictions)
    replay = Correction(window) if window else None
    for i, (told, measured), raw in zip(busy, log.predictions, log.raw_predictions):
        prefill = log.batch_tokens[i] > log.batch_seqs[i]
        factor = replay.factor(prefill=prefill) if replay else 1.0
        assert told == pytest.approx(raw * factor, rel=1e-9), f"iteration {i}"
        if replay:
            replay.observe(prefill=prefill, predicted_ms=raw, measured_ms=measured)
    if window:
        assert replay.factor(prefill=False) > 1.0, "the profile is stale: the steps were slower"
    else:
        assert error["median"] == error["raw_median"]


def test_the_simulator_never_corrects():
    rt = tuple(RequestSpec(index=i, arrival_s=0.02 * i, prompt_tokens=200 + 10 * i,
                           output_tokens=20, ttft_ms=400.0, tpot_ms=200.0) for i in range(20))
    workload = Workload(name="rt", description="", params={}, requests=rt, duration_s=0.4)
    base = EngineConfig(backend="sim", num_blocks=400)
    with pytest.raises(ConfigError, match="cost_correction is for the torch backend"):
        attrs.evolve(base, cost_correction=16)  # a window there would be ignored: refused
    assert base.correction_window == 0
    default, off = (run_one(BROS, workload, c, progress=False)
                    for c in (base, attrs.evolve(base, cost_correction=0)))
    assert default.error is None and off.error is None
    assert list(default.log.predictions) == list(off.log.predictions)
    measured = ("scheduler_ms_per_iteration", "scheduler_share")  # this CPU's time
    assert ({k: v for k, v in default.metrics.as_dict().items() if k not in measured}
            == {k: v for k, v in off.metrics.as_dict().items() if k not in measured})
    # charged, every step takes longer than the model by the scheduler's CPU time: a
    # correction would follow it; the sim's predictions stay its model's
    charged = run_one(BROS, workload, attrs.evolve(base, charge_scheduler_time=True),
                      progress=False)
    assert charged.metrics.cost_model_error["median"] > 0
    assert list(charged.log.raw_predictions) == [p for p, _ in charged.log.predictions]


def test_a_negative_window_is_refused_and_the_default_is_8_steps_on_torch():
    with pytest.raises(ConfigError, match="cost_correction must be >= 0"):
        EngineConfig(cost_correction=-1)
    assert EngineConfig().correction_window == 8
    assert EngineConfig(cost_correction=0).correction_window == 0
