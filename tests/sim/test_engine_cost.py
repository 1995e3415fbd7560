"""Issue 18: the engine's own cost on the simulator's clock, and the fits made from a real
engine's recorded steps."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from engine.cost_model import BatchShape, CostModel
from engine.messages import ExecuteStep, SeqWork
from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.cli import main
from shunter.fidelity import (
    RecordedRun,
    StepRecord,
    copy_dispatch_us,
    engine_gaps,
    fit_engine_cost,
    fit_rows,
    recorded_run,
)
from shunter.workloads import load_workload
from sim.fit import fit_recorded_steps, total_ratio
from sim.profile import (
    CopyLink,
    EngineCost,
    ModelShape,
    Profile,
    list_profiles,
    load_profile,
    save_profile,
)
from sim.runner import SimRunner

COST = CostModel(a_ms=2.0, b_ms_per_prefill_token=0.05, c_ms_per_prefill_token_sq=1e-4,
                 d_ms_per_decode_seq=0.3, e_ms_per_decode_context_token=0.002)
SMALL = "be-batch:batch_size=3,batches=2,be_prompt=8-40,be_output=2-6"
"""Synthetic (no trace files): 6 requests in two closed-loop batches."""
ENGINE = EngineCost(per_iteration_ms=0.7, per_seq_ms=0.05, per_sampled_ms=0.02, before_share=0.4,
                    source="test")


def _step_time(engine_cost: EngineCost | None) -> float:
    """Virtual seconds one step of 3 sequences (2 sampled) takes on a SimRunner."""
    runner = SimRunner(COST, 64, engine_cost=engine_cost)
    seqs = (SeqWork(request_id=1, start=0, num_tokens=40, sample=True),
            SeqWork(request_id=2, start=100, num_tokens=1, sample=True),
            SeqWork(request_id=3, start=0, num_tokens=30, sample=False))

    async def go() -> float:
        await runner.step(ExecuteStep(step_id=1, release=(), setups=(), blocks=(), seqs=seqs))
        return trio.current_time()

    return trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))


def test_sim_runner_charges_the_engine_cost_around_each_step():
    compute = COST.predict_ms(BatchShape.of([(0, 40), (100, 1), (0, 30)])) / 1000
    assert _step_time(None) == pytest.approx(compute)
    around = (0.7 + 0.05 * 3 + 0.02 * 2) / 1000  # 3 sequences computed, 2 sampled
    assert _step_time(ENGINE) == pytest.approx(compute + around)


def test_profiles_carry_the_engine_cost_only_when_fitted(tmp_path):
    shape = ModelShape(name="toy", num_layers=2, hidden_size=64, intermediate_size=128,
                       num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=500)
    base = Profile(name="toy", model=shape, gpu="toy", gpu_memory_gib=1.0, cost=COST,
                   link=CopyLink(bandwidth_gb_per_s=10.0, dispatch_us=5.0), source="test")
    assert "engine_cost" not in base.to_json()
    with_cost = Profile.from_json(attrs.evolve(base, engine_cost=ENGINE).to_json(), "t")
    assert with_cost.engine_cost == ENGINE
    # the shipped GPU profiles charge nothing: other benchmarks' numbers stay as they were
    assert all(load_profile(name).engine_cost is None for name in list_profiles())


def _run(gaps: list[tuple[int, int, float]], idle_after: int) -> RecordedRun:
    """Steps of 5 ms, each followed by (seqs, sampled, gap ms): the next step is planned 40%
    into the gap; after step `idle_after` the engine first idles 0.5 s (its requests ended; the
    next step serves a new one)."""
    steps, planned, t = [], [0.0], 0.0001
    for i, (seqs, sampled, gap) in enumerate(gaps):
        ids = frozenset({1 if i <= idle_after else 2})
        steps.append(StepRecord(shape=BatchShape(decode_seqs=seqs, decode_context=seqs * 64),
                                seqs=seqs, sampled=sampled, began=t, ended=t + 0.005, stall_s=0.0,
                                request_ids=ids))
        plan = t + 0.005 + gap / 1000 * 0.4 + (0.5 if i == idle_after else 0.0)
        planned.append(plan)
        t = plan + gap / 1000 * 0.6
    return RecordedRun(metrics=None, steps=tuple(steps), planned=tuple(planned[:-1]), wall_s=t,
                       swap={})


def test_engine_cost_fit_recovers_the_gaps_and_leaves_out_idle_time():
    rng = np.random.default_rng(0)
    rows = [(int(n), int(k)) for n, k in zip(rng.integers(1, 30, 80), rng.integers(0, 30, 80))]
    truth = [(n, min(k, n), 0.6 + 0.04 * n + 0.01 * min(k, n)) for n, k in rows]
    run = _run(truth, idle_after=10)
    gaps = engine_gaps(run)
    assert len(gaps) == len(truth) - 2  # the last step has no next; the idle one is left out
    assert all(g[1] < 5 for g in gaps)
    assert all(g[2] == pytest.approx(g[1] * 0.6) for g in gaps)
    fit = fit_engine_cost([run], source="synthetic")
    assert fit.per_iteration_ms == pytest.approx(0.6, abs=0.02)
    assert fit.per_seq_ms + fit.per_sampled_ms == pytest.approx(0.05, abs=0.005)
    assert fit.before_share == pytest.approx(0.6, abs=0.01)


def test_recorded_step_fit_adds_up_the_measured_time_and_reports_held_out_error():
    rng = np.random.default_rng(1)

    def rows(n: int) -> list[tuple[BatchShape, float]]:
        out = []
        for _ in range(n):
            d, p = int(rng.integers(0, 20)), int(rng.choice([0, 0, 0, 32, 200]))
            shape = BatchShape.of([(int(rng.integers(10, 400)), 1) for _ in range(d)]
                                  + ([(0, p)] if p else []) or [(0, 8)])
            out.append((shape, COST.predict_ms(shape) * float(rng.lognormal(0.0, 0.15))))
        return out

    train, held = rows(300), rows(200)
    fit = fit_recorded_steps(train, source="synthetic", held_out=held)
    assert total_ratio(fit.cost, train) == pytest.approx(1.0)
    assert total_ratio(fit.cost, held) == pytest.approx(1.0, abs=0.05)
    assert fit.held_out_rows == 200 and fit.held_out_median_error < 0.15
    assert fit.cost.d_ms_per_decode_seq > 0 and fit.cost.b_ms_per_prefill_token > 0


def test_a_recorded_torch_run_has_every_step_with_its_time(tiny_llama_dir):
    cfg = EngineConfig(model=tiny_llama_dir, device="cpu", threads=1)
    run = recorded_run(parse_policy("fcfs"), load_workload(SMALL, seed=0), cfg)
    assert run.metrics.completed == 6
    assert 6 <= len(run.steps) <= run.metrics.iterations  # iterations that only release: no step
    assert all(s.compute_ms > 0 and s.ended > s.began for s in run.steps)
    assert len(fit_rows([run])) == len(run.steps)
    # steps follow their plans on one clock: each began after it was planned
    assert all(p <= s.began for p, s in zip(run.planned, run.steps))


def test_profile_fit_on_a_workload_charges_its_engine_cost_in_the_sim(tiny_llama_dir, tmp_path):
    out = tmp_path / "rec.json"
    assert main(["profile", "fit", "--model", str(tiny_llama_dir), "--threads", "1",
                 "--kv-cache-mib", "8", "--workload", SMALL, "--workload", SMALL.replace("3", "4", 1),
                 "--out", str(out)]) == 0
    profile = load_profile(out)
    assert profile.engine_cost is not None and profile.engine_cost.ms(1, 1) > 0
    assert "fitted on recorded engine steps" in profile.cost.source
    plain = attrs.evolve(profile, engine_cost=None)
    save_profile(plain, tmp_path / "plain.json")
    spans = {}
    for name in ("rec", "plain"):
        cfg = EngineConfig(backend="sim", profile=str(tmp_path / f"{name}.json"))
        o = run_one(parse_policy("fcfs"), load_workload(SMALL, seed=0), cfg, progress=False)
        assert o.metrics.completed == 6
        spans[name] = o.metrics.duration_s
    assert spans["rec"] > spans["plain"]  # the engine's own time is on the virtual clock


def test_the_copy_link_takes_the_per_call_cost_the_recorded_copies_took():
    def run(calls: int, nbytes: int, seconds: float) -> RecordedRun:
        return RecordedRun(metrics=None, steps=(), planned=(), wall_s=1.0, copy_s=seconds,
                           swap={"copy_ops": calls, "bytes_in": nbytes // 2, "bytes_out": nbytes // 2})

    # 1,000 calls moving 1 GB at 10 GB/s in 0.15 s: 0.1 s of bytes, 50 us a call
    assert copy_dispatch_us([run(600, 600_000_000, 0.09), run(400, 400_000_000, 0.06)],
                            10.0, 5.0) == pytest.approx(50.0)
    assert copy_dispatch_us([run(1000, 10**9, 0.101)], 10.0, 5.0) == 5.0  # measured is more
    assert copy_dispatch_us([run(0, 0, 0.0)], 10.0, 5.0) == 5.0  # no swaps: as measured
