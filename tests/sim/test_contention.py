"""Issue 18: on a CPU backend the swap copies share the cores with the engine. The simulator
charges the copying that overlaps a step and the engine's own work around it (a profile fitted
on a CPU torch run carries the charge; GPU profiles keep a copy engine that overlaps for free),
and the engine's work before a step overlaps the copies issued with its plan."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
import trio
import trio.testing

from engine.config import EngineConfig
from engine.cost_model import BatchShape, CostModel
from engine.messages import ExecuteStep, SeqWork
from shunter import fidelity
from shunter.contention import CopySpans, excess_per_copy_ms, fit_contention
from shunter.fidelity import RecordedRun, StepRecord, contention_rows, profile_from_runs
from sim.copy_engine import CopyEngine
from sim.profile import (
    CopyContention,
    CopyLink,
    EngineCost,
    ModelShape,
    Profile,
    list_profiles,
    load_profile,
)
from sim.runner import SimRunner

COST = CostModel(a_ms=2.0, b_ms_per_prefill_token=0.05, c_ms_per_prefill_token_sq=0.0,
                 d_ms_per_decode_seq=0.5, e_ms_per_decode_context_token=0.0)
ENGINE = EngineCost(per_iteration_ms=2.0, before_share=0.5, source="test")  # 1 ms either side
SHAPE = ModelShape(name="toy", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                   num_kv_heads=2, head_dim=16, vocab_size=500)
LINK = CopyLink(bandwidth_gb_per_s=1000.0, dispatch_us=10_000.0)
"""One copy call takes 10 ms (plus a negligible 0.5 us for a block's bytes)."""
COPY_S = LINK.copy_s(1, SHAPE.block_bytes(16))
STEP_S = (2.0 + 0.5) / 1000  # one decode


def _step(contention: CopyContention | None, copies: list[tuple[float, str]],
          wait: bool = False, engine: EngineCost = ENGINE) -> tuple[float, float, float]:
    """(virtual seconds from the plan to the step's end, its stall, the charge for copies) of
    one decode step planned at t=20 ms on a SimRunner whose swapper is handed a 10 ms copy at
    each (time, direction) of `copies` (those after 20 ms while the step runs); `wait`: the
    step waits for the first (a synchronous swap-in)."""
    runner = SimRunner(COST, 64, link=LINK, model=SHAPE, engine_cost=engine, contention=contention)
    seqs = (SeqWork(request_id=1, start=10, num_tokens=1, sample=True),)

    async def go() -> tuple[float, float]:
        swapper = await runner.make_swapper(16)

        async def late() -> None:
            for i, (at, direction) in enumerate(copies):
                if at > 0.02:
                    await trio.sleep_until(at)
                    swapper.submit(i, direction, [(i, i)], "groups")

        async with trio.open_nursery() as nursery:
            for i, (at, direction) in enumerate(copies):
                if at <= 0.02:
                    await trio.sleep_until(at)
                    swapper.submit(i, direction, [(i, i)], "groups")
            nursery.start_soon(late)
            await trio.sleep_until(0.02)
            done = await runner.step(ExecuteStep(step_id=1, release=(), setups=(), blocks=(),
                                                 seqs=seqs, wait_tickets=(0,) if wait else ()))
            return trio.current_time() - 0.02, done.stall_s

    took, stall = trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))
    return took, stall, runner.contention_s


# the step: 1 ms of engine work (20-21 ms), the decode (21-23.5 ms), 1 ms more (23.5-24.5 ms)
BESIDE = [(0.0125, "out"), (0.022, "in")]
"""One copy out 12.5-22.5 ms (1 ms beside the engine, 1.5 ms beside the decode), one in from
22 ms on, after the step's own input copy was issued (1.5 ms beside the decode, 1 ms beside the
engine after it)."""


def test_copies_beside_the_step_and_the_engine_lengthen_them_by_the_profiles_charge():
    charge = CopyContention(engine=1.5, step=0.4, source="test")
    plain, _, free = _step(None, BESIDE)
    assert free == 0.0 and plain == pytest.approx(0.001 + STEP_S + 0.001)  # overlap for free
    took, stall, charged = _step(charge, BESIDE)
    assert stall == 0.0
    want = 1.5 * (0.001 + 0.001) + 0.4 * 0.003
    assert charged == pytest.approx(want, rel=1e-6)
    assert took == pytest.approx(plain + want, rel=1e-6)


def test_copies_that_ended_before_the_step_are_not_charged():
    charge = CopyContention(engine=1.5, step=0.4, source="test")
    took, _, charged = _step(charge, [(0.0, "out"), (0.005, "in")])  # both over by 15 ms
    assert charged == 0.0 and took == pytest.approx(0.002 + STEP_S)


def test_the_engine_work_before_a_step_overlaps_the_copy_it_waits_for():
    # a synchronous swap-in issued with the plan: the plan's trip to the device (1 ms of engine
    # time) runs beside the copy, and the step waits for the remaining 9 ms of it only
    took, stall, _ = _step(None, [(0.02, "in")], wait=True)
    assert stall == pytest.approx(COPY_S - 0.001)
    assert took == pytest.approx(COPY_S + STEP_S + 0.001)
    # ... and the copies start the engine's hop to its copier after the plan
    hop = attrs.evolve(ENGINE, copy_start_ms=0.4)
    took, stall, _ = _step(None, [(0.02, "in")], wait=True, engine=hop)
    assert stall == pytest.approx(0.0004 + COPY_S - 0.001)
    assert took == pytest.approx(0.0004 + COPY_S + STEP_S + 0.001)


def test_copy_engine_busy_time_adds_up_both_directions():
    eng = CopyEngine(CopyLink(bandwidth_gb_per_s=1.0, dispatch_us=0.0), track_busy=True)
    eng.submit(0.0, "out", 1, 10**7)  # 0.00-0.01
    eng.submit(0.0, "out", 1, 10**7)  # queued behind: 0.01-0.02
    eng.submit(0.005, "in", 1, 10**7)  # beside them: 0.005-0.015
    assert eng.busy_s(0.0, 0.02) == pytest.approx(0.03)
    assert eng.busy_s(0.012, 0.018) == pytest.approx(0.006 + 0.003)
    assert eng.busy_s(0.03, 0.04) == 0.0
    assert CopyEngine(CopyLink(bandwidth_gb_per_s=1.0, dispatch_us=0.0)).busy_s(0.0, 1.0) == 0.0


def test_copy_spans_count_concurrent_and_long_copies():
    spans = CopySpans([(0.0, 0.010), (0.004, 0.006), (0.020, 0.030)])
    assert spans.ms(0.005, 0.025) == pytest.approx(5.0 + 1.0 + 5.0)
    assert spans.ms(0.011, 0.019) == 0.0 and not CopySpans([])


def test_the_fit_recovers_the_charges_from_rows_with_copying_beside_them():
    rng = np.random.default_rng(0)
    steps, gaps = [], []
    for _ in range(300):
        pred, copy = float(rng.uniform(2, 10)), float(rng.choice([0.0, rng.uniform(0, 3)]))
        steps.append((pred + 0.3 * copy, pred, copy))
        gaps.append((1.0 + 1.2 * copy, 1.0, copy))
    got = fit_contention(steps, gaps, source="synthetic")
    assert got.step == pytest.approx(0.3, rel=0.02)
    assert got.engine == pytest.approx(1.2, rel=0.02)
    assert excess_per_copy_ms([(5.0, 6.0, 2.0)] * 10)[0] == 0.0  # never negative
    assert excess_per_copy_ms([(5.0, 5.0, 0.0)]) == (0.0, 0, 0.0)


def _swapping_run(extra_per_copy_ms: float) -> RecordedRun:
    """Decode steps of 4 ms with 1 ms gaps; every other gap has a 0.5 ms copy beside it, which
    lengthens that gap by `extra_per_copy_ms` per ms."""
    steps, planned, spans, t = [], [-0.001], [], 0.0
    for i in range(60):
        steps.append(StepRecord(shape=BatchShape(decode_seqs=2, decode_context=100 + i), seqs=2,
                                sampled=2, began=t, ended=t + 0.004, stall_s=0.0,
                                request_ids=frozenset({1})))
        gap = 0.001
        if i % 2:
            spans.append((t + 0.0042, t + 0.0047))
            gap += 0.0005 * extra_per_copy_ms
        planned.append(t + 0.004 + gap / 2)
        t += 0.004 + gap
    return RecordedRun(metrics=None, steps=tuple(steps), planned=tuple(planned[:-1]),
                       wall_s=t, swap={"copy_ops": 30, "bytes_out": 30 * 4096},
                       copy_s=0.015, copy_spans=tuple(spans))


def test_the_copies_start_is_fitted_from_the_plans_and_the_copies():
    # plans every 10 ms; a swap handed to the copier 0.3 ms after every other plan (its copy
    # starting 0.2 ms later: the copier's queue, which the sim's copy engine models itself)
    planned = tuple(0.01 * i for i in range(20))
    submits = tuple(p + 0.0003 for p in planned[1::2])
    spans = tuple((t + 0.0002, t + 0.001) for t in submits)
    run = RecordedRun(metrics=None, steps=(), planned=planned, wall_s=0.2, swap={},
                      swap_submits=submits, copy_spans=spans)
    assert fidelity.copy_start_ms([run]) == pytest.approx(0.3)
    assert fidelity.copy_start_ms([attrs.evolve(run, copy_spans=())]) == 0.0  # none copied


def test_a_cpu_profile_carries_the_fitted_charge_and_a_gpu_one_none(tiny_llama_dir, monkeypatch):
    run = _swapping_run(2.0)
    _, gaps = contention_rows([run], COST, ENGINE)
    assert sum(1 for *_, c in gaps if c > 0) == 29  # the last step has no gap after it
    kw = {"name": "t", "kv_cache_mib": 8, "gb_per_s": 5.0, "dispatch_us": 5.0, "source": "test"}
    config = EngineConfig(model=tiny_llama_dir, device="cpu")
    cpu, _ = profile_from_runs(config, [run], **kw)
    assert cpu.copy_contention is not None
    assert cpu.copy_contention.engine == pytest.approx(2.0, rel=0.05)
    assert cpu.copy_contention.step == 0.0  # no copy ran beside a step
    # the engine cost was fitted on the gaps without copies: 1 ms, not their mean
    assert cpu.engine_cost.ms(2, 2) == pytest.approx(1.0, rel=0.02)
    # recorded on a GPU (its copy engine runs beside compute): no charge
    monkeypatch.setattr(fidelity, "resolve_device", lambda name: torch.device("cuda"))
    gpu, _ = profile_from_runs(config, [run], **kw)
    assert gpu.copy_contention is None


def test_profiles_carry_the_charge_only_when_fitted():
    base = Profile(name="toy", model=SHAPE, gpu="toy", gpu_memory_gib=1.0, cost=COST, link=LINK,
                   source="test")
    assert "copy_contention" not in base.to_json()
    charge = CopyContention(engine=1.0, step=0.2, source="t")
    again = Profile.from_json(attrs.evolve(base, copy_contention=charge).to_json(), "t")
    assert again.copy_contention == charge
    assert all(load_profile(n).copy_contention is None for n in list_profiles())
