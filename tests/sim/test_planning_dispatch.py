"""Issue 18, round 3: what the FastSwitch iterations cost a real engine, charged where it
arises. The cost model's multi-row term; the engine cost fitted net of the scheduler's planning,
which the sim then charges from its own planning times the measured real/sim ratio; the detour a
swapping iteration's plan takes through the swap pool, during which its copies already run."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from engine.config import EngineConfig
from engine.cost_model import BatchShape, CostModel
from engine.messages import ExecuteStep, SeqWork
from policies import policy_path
from shunter import fidelity
from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.run import run_one
from shunter.fidelity import RecordedRun, StepRecord, fit_engine_cost, fit_swap_dispatch
from shunter.workloads import BatchSource, Workload
from sim.fit import fit_cost_model, fit_recorded_steps
from sim.profile import CopyLink, EngineCost, ModelShape, Profile, load_profile, save_profile
from sim.runner import SimRunner

TRUE = CostModel(a_ms=3.0, b_ms_per_prefill_token=0.1, c_ms_per_prefill_token_sq=0.0,
                 d_ms_per_decode_seq=0.3, e_ms_per_decode_context_token=0.002, g_ms_multi_row=1.5)


def test_a_step_of_more_than_one_token_row_costs_the_multi_row_term():
    one, two = BatchShape.of([(100, 1)]), BatchShape.of([(100, 1), (50, 1)])
    assert TRUE.predict_ms(one) == pytest.approx(3.0 + 0.3 + 0.002 * 101)
    assert TRUE.predict_ms(two) == pytest.approx(3.0 + 0.6 + 0.002 * 152 + 1.5)
    assert TRUE.predict_ms(BatchShape.of([(0, 8)])) == pytest.approx(3.0 + 0.8 + 1.5)
    assert TRUE.iteration_of(0, 0, 0, 0, 0) == 0.0  # an empty step costs nothing


def _rows(n: int, seed: int) -> list[tuple[BatchShape, float]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        d, p = int(rng.choice([1, 1, 2, 3, 5, 9])), int(rng.choice([0, 0, 0, 16, 120]))
        shape = BatchShape.of([(int(rng.integers(10, 300)), 1) for _ in range(d)]
                              + ([(0, p)] if p else []))
        out.append((shape, TRUE.predict_ms(shape)))
    return out


def test_the_recorded_step_fit_finds_the_multi_row_term(tmp_path):
    fit = fit_recorded_steps(_rows(300, 0), source="t", held_out=_rows(100, 1))
    assert fit.cost.g_ms_multi_row == pytest.approx(1.5, rel=1e-4)
    assert fit.median_relative_error < 1e-6 and fit.held_out_median_error < 1e-6
    without = fit_recorded_steps(_rows(300, 0), source="t", multi_row=False)
    assert without.cost.g_ms_multi_row == 0.0 and without.median_relative_error > 0.02
    # the grid's split fit (BROS §4.1) never uses it: shipped and grid profiles unchanged
    assert fit_cost_model(_rows(300, 0), source="grid").cost.g_ms_multi_row == 0.0
    assert all(load_profile(n).cost.g_ms_multi_row == 0.0 for n in ("llama3-8b-a100",))
    shape = ModelShape(name="toy", num_layers=2, hidden_size=64, intermediate_size=128,
                       num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=500)
    p = Profile(name="toy", model=shape, gpu="toy", gpu_memory_gib=1.0, cost=fit.cost,
                link=CopyLink(bandwidth_gb_per_s=10.0, dispatch_us=5.0))
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").cost.g_ms_multi_row == fit.cost.g_ms_multi_row


def _planning_run(n: int = 60) -> RecordedRun:
    """4 ms steps of one request; after each, 0.2 ms of engine work, the next plan (the
    scheduler's planning takes 0.1-0.6 ms), a swap handed to the copier 0.1 ms after the
    planning on every other plan, and 0.3 ms more before the next step: net of the planning,
    every gap is 0.5 ms, 60% of it before the step."""
    rng = np.random.default_rng(2)
    steps, planned, sched, submits, t = [], [], [], [], 0.0
    for i in range(n):
        steps.append(StepRecord(shape=BatchShape(decode_seqs=2, decode_context=100), seqs=2,
                                sampled=2, began=t, ended=t + 0.004, stall_s=0.0,
                                request_ids=frozenset({1})))
        plan, p = t + 0.0042, float(rng.uniform(0.0001, 0.0006))
        planned.append(plan)
        sched.append(p)
        if i % 2:
            submits.append(plan + p + 0.0001)
        t = plan + p + 0.0003
    return RecordedRun(metrics=None, steps=tuple(steps), planned=tuple(planned), wall_s=t,
                       swap={}, swap_submits=tuple(submits), scheduler_s=tuple(sched),
                       copy_spans=tuple((s, s + 0.0001) for s in submits))


def test_the_engine_cost_is_fitted_net_of_the_schedulers_planning():
    run = _planning_run()
    net = fit_engine_cost([run], "t", net_of_scheduler=True)
    assert net.ms(2, 2) == pytest.approx(0.5, abs=1e-6)
    assert net.before_share == pytest.approx(0.6, abs=1e-6) and net.planning_scale == 1.0
    gross = fit_engine_cost([run], "t")
    assert gross.planning_scale is None
    assert gross.ms(2, 2) == pytest.approx(0.5 + 1000 * np.mean(run.scheduler_s[1:]), abs=0.02)
    assert fidelity.copy_start_ms([run], net_of_scheduler=True) == pytest.approx(0.1)
    assert fidelity.copy_start_ms([run]) > 0.2
    assert fidelity.planning_scale([run], sum(run.scheduler_s) / 2) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="scheduler's times"):
        fit_engine_cost([attrs.evolve(run, scheduler_s=())], "t", net_of_scheduler=True)
    # what copies add is fitted against the same net gaps, the detour before a step in the
    # prediction (here every other plan issued one transfer)
    detour = attrs.evolve(net, swap_dispatch_ms=0.3)
    _, gaps = fidelity.contention_rows([run], TRUE, detour)
    assert [g[0] for g in gaps] == pytest.approx([0.5] * (len(run.steps) - 1), abs=1e-6)
    want = [0.5 + 0.3 * (i % 2) for i in range(len(run.steps) - 1)]
    assert [g[1] for g in gaps] == pytest.approx(want, abs=1e-6)


WORKLOAD = Workload(name="be", description="", params={}, requests=(), duration_s=0.0,
                    batches=(BatchSource(batch_size=8, max_batches=3, prompt_range=(64, 256),
                                         output_range=(8, 32)),))


@pytest.mark.parametrize("scale", [None, 3.0])
def test_a_profile_net_of_planning_charges_the_sims_own_planning_times_its_scale(tmp_path, scale):
    base = load_profile("llama3-8b-a100")
    path = tmp_path / "p.json"
    save_profile(attrs.evolve(base, engine_cost=EngineCost(planning_scale=scale)), path)
    config = EngineConfig(backend="sim", num_blocks=400, profile=str(path))
    run = run_one(PolicyChoice(label="bros", path=policy_path("bros")), WORKLOAD, config,
                  progress=False)
    log = run.log
    busy = [i for i in range(len(log)) if log.batch_seqs[i]]
    # each busy iteration lasts its predicted step plus (net profile) its planning x scale
    extra = [log.time[i + 1] - log.time[i] - p / 1000.0 - (scale or 0.0) * log.scheduler_s[i]
             for i, (p, _) in zip(busy, log.predictions) if i + 1 < len(log)]
    assert sum(abs(e) < 1e-9 for e in extra) >= len(extra) - 3  # idle waits between batches
    assert min(extra) > -1e-9


def _dispatch_run(engine: EngineCost) -> RecordedRun:
    """Steps whose plans issued 0-4 swaps (0.1 ms apart, from 0.1 ms after the plan); the
    step starts the engine cost's share before it + 0.2 ms + 0.05 ms a transfer after the plan
    when it issued any."""
    steps, planned, submits, t = [], [], [], 0.0
    for i in range(50):
        issued = i % 5
        planned.append(t)
        submits += [t + 0.0001 * (k + 1) for k in range(issued)]
        began = t + (engine.ms(2, 2) * engine.before_share
                     + (0.2 + 0.05 * issued if issued else 0.0)) / 1000.0
        steps.append(StepRecord(shape=BatchShape(decode_seqs=2, decode_context=100), seqs=2,
                                sampled=2, began=began, ended=began + 0.004, stall_s=0.0))
        t = began + 0.005
    return RecordedRun(metrics=None, steps=tuple(steps), planned=tuple(planned), wall_s=t,
                       swap={}, swap_submits=tuple(submits))


def test_the_swap_pools_detour_is_fitted_from_each_steps_time_after_its_plan():
    engine = EngineCost(per_iteration_ms=1.0, before_share=0.5)
    got = fit_swap_dispatch([_dispatch_run(engine)], engine)
    assert got.swap_dispatch_ms == pytest.approx(0.2, abs=1e-6)
    assert got.per_transfer_ms == pytest.approx(0.05, abs=1e-6)
    assert got.swap_ms(0) == 0.0 and got.swap_ms(3) == pytest.approx(0.35)
    # runs without swaps leave it as it was
    assert fit_swap_dispatch([attrs.evolve(_dispatch_run(engine), swap_submits=())], engine) == engine


SHAPE = ModelShape(name="toy", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                   num_kv_heads=2, head_dim=16, vocab_size=500)
LINK = CopyLink(bandwidth_gb_per_s=1000.0, dispatch_us=10_000.0)  # a copy call: 10 ms
COPY_S = LINK.copy_s(1, SHAPE.block_bytes(16))
COST = CostModel(a_ms=2.0, b_ms_per_prefill_token=0.05, c_ms_per_prefill_token_sq=0.0,
                 d_ms_per_decode_seq=0.5, e_ms_per_decode_context_token=0.0)
STEP_S = 0.0025  # one decode


def _swapping_step(engine: EngineCost, transfers: int) -> tuple[float, float, float]:
    """(virtual seconds from the plan to the step's end, its stall, the engine time charged)
    of one decode step whose plan issued `transfers` 10 ms copies (alternating directions) and
    waits for the first (a synchronous swap-in)."""
    runner = SimRunner(COST, 64, link=LINK, model=SHAPE, engine_cost=engine)

    async def go() -> tuple[float, float]:
        swapper = await runner.make_swapper(16)
        for i in range(transfers):
            swapper.submit(i, "in" if i % 2 == 0 else "out", [(i, i)], "groups")
        seqs = (SeqWork(request_id=1, start=10, num_tokens=1, sample=True),)
        done = await runner.step(ExecuteStep(step_id=1, release=(), setups=(), blocks=(),
                                             seqs=seqs, wait_tickets=(0,) if transfers else ()))
        return trio.current_time(), done.stall_s

    took, stall = trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))
    return took, stall, runner.engine_s


def test_the_detour_through_the_swap_pool_runs_beside_the_copies_it_issued():
    engine = EngineCost(per_iteration_ms=2.0, before_share=0.5, swap_dispatch_ms=3.0,
                        per_transfer_ms=1.0)
    # no swaps: 1 ms of engine work either side of the step, no detour
    took, stall, charged = _swapping_step(engine, 0)
    assert stall == 0.0 and took == pytest.approx(0.001 + STEP_S + 0.001)
    assert charged == pytest.approx(0.002)
    # two swaps: 1 ms + 3 ms + 2 x 1 ms before the step, while the 10 ms copy it waits for runs
    took, stall, charged = _swapping_step(engine, 2)
    assert charged == pytest.approx(0.002 + 0.005)
    assert stall == pytest.approx(COPY_S - 0.006)
    assert took == pytest.approx(COPY_S + STEP_S + 0.001)
