"""Issue 18, round 4: the torch copier's thread hops, measured from recorded runs and charged by
the simulator. A transfer handed to an idle copier starts once a worker has woken up (pickup);
a step that waited for a running copy resumes once the device thread has woken up (wake); a
step computing sequences swapped in for it runs longer per such sequence (swapped-in)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from engine.config import EngineConfig
from engine.cost_model import BatchShape, CostModel
from engine.messages import ExecuteStep, SeqWork
from shunter.copier_timing import copy_pickup_ms, fit_swapped_in, pickups, stall_wake_ms
from shunter.fidelity import RecordedRun, StepRecord, copy_start_ms, profile_from_runs
from sim.profile import CopyContention, CopyLink, EngineCost, ModelShape, Profile, load_profile
from sim.runner import SimRunner
from sim.swap import SimSwapper

COST = CostModel(a_ms=2.0, b_ms_per_prefill_token=0.05, c_ms_per_prefill_token_sq=0.0,
                 d_ms_per_decode_seq=0.5, e_ms_per_decode_context_token=0.01)
SHAPE = ModelShape(name="toy", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                   num_kv_heads=2, head_dim=16, vocab_size=500)
LINK = CopyLink(bandwidth_gb_per_s=1e6, dispatch_us=1000.0)
"""One copy call takes 1 ms (the bytes are free)."""


def _copier_run(iterations: int = 20) -> RecordedRun:
    """An iteration every 10 ms (T): two transfers handed to the idle copier at T and T+20 us;
    the first copies 0.3 ms after its submission (the pickup), the second right after it; a
    third handed over at T+1 ms, while the second copies, starts 0.25 ms later. Each
    iteration's step waits from T+0.5 ms for the copies and resumes 40 us after the second
    ends; a step of the next iteration stalls 20 us with no copy ending meanwhile."""
    submits, spans, steps = [], [], []
    for i in range(iterations):
        t = 0.01 * i
        submits += [t, t + 0.00002, t + 0.001]
        spans += [(t + 0.0003, t + 0.0008), (t + 0.00081, t + 0.0012), (t + 0.00125, t + 0.0014)]
        shape = BatchShape(decode_seqs=2, decode_context=200)
        ids = frozenset({1})
        steps.append(StepRecord(shape=shape, seqs=2, sampled=2, began=t + 0.0005,
                                ended=t + 0.005, stall_s=0.0012 + 0.00004 - 0.0005, request_ids=ids))
        steps.append(StepRecord(shape=shape, seqs=2, sampled=2, began=t + 0.006,
                                ended=t + 0.009, stall_s=0.00002, request_ids=ids))
    planned = sorted([0.01 * i for i in range(iterations)] + [0.01 * i + 0.0055 for i in range(iterations)])
    return RecordedRun(metrics=None, steps=tuple(steps), planned=tuple(planned),
                       wall_s=0.01 * iterations, swap={}, swap_submits=tuple(submits),
                       copy_spans=tuple(spans))


def test_the_pickup_is_measured_on_submissions_to_an_idle_copier_only():
    run = _copier_run()
    got = pickups(run)
    assert len(got) == 20  # the second (its predecessor not started) and third (one copying) are left out
    assert got == pytest.approx([0.0003] * 20)
    assert copy_pickup_ms([run]) == pytest.approx(0.3)
    assert copy_pickup_ms([attrs.evolve(run, copy_spans=())]) == 0.0  # a run that did not copy


def test_the_copies_start_counts_each_plans_first_hand_over():
    # the sim hands an iteration's transfers to its copier at once, and the pickup counts from
    # the first: so does the hop to the copier (the second, 20 us later, and the third are left out)
    run = _copier_run()
    assert copy_start_ms([run]) == pytest.approx(0.0)
    later = attrs.evolve(run, planned=tuple(p - 0.0003 for p in run.planned))
    assert copy_start_ms([later]) == pytest.approx(0.3)


def test_the_wake_is_measured_from_the_last_copy_inside_a_stall_to_its_end():
    run = _copier_run()
    assert stall_wake_ms([run]) == pytest.approx(0.04)
    assert stall_wake_ms([attrs.evolve(run, copy_spans=())]) == 0.0


def _swap_in_run(level: float, beta_ms: float, seed: int) -> RecordedRun:
    """Steps taking `level` x COST plus `beta_ms` per ticket waited for; every fifth has a copy
    beside it and 5 ms more (not a row of the fit)."""
    rng = np.random.default_rng(seed)
    steps, spans, t = [], [], 0.0
    for i in range(200):
        d, ctx, waited = int(rng.integers(1, 6)), int(rng.integers(20, 300)), int(rng.integers(0, 3))
        shape = BatchShape(decode_seqs=d, decode_context=d * ctx)
        ms = level * COST.predict_ms(shape) + beta_ms * waited
        if i % 5 == 0:
            spans.append((t + 0.0005, t + 0.001))
            ms += 5.0
        steps.append(StepRecord(shape=shape, seqs=d, sampled=d, began=t, ended=t + ms / 1000,
                                stall_s=0.0, waited=waited))
        t += ms / 1000 + 0.001
    return RecordedRun(metrics=None, steps=tuple(steps), planned=(), wall_s=t, swap={},
                       copy_spans=tuple(spans))


def test_the_swapped_in_charge_is_fitted_with_each_runs_own_level():
    runs = [_swap_in_run(1.0, 0.2, 0), _swap_in_run(1.1, 0.2, 1)]
    assert fit_swapped_in(runs, COST) == pytest.approx(0.2, rel=1e-6)
    assert fit_swapped_in([_swap_in_run(0.9, 0.0, 2)], COST) == pytest.approx(0.0, abs=1e-9)
    none = attrs.evolve(runs[0], steps=tuple(attrs.evolve(s, waited=0) for s in runs[0].steps))
    assert fit_swapped_in([none], COST) == 0.0  # no step waited for a ticket


async def _submit_at(swapper: SimSwapper, at: float, ticket: int, direction: str) -> None:
    await trio.sleep_until(at)
    swapper.submit(ticket, direction, [(ticket, ticket)], "groups")


def _ends(pickup_s: float) -> dict[int, float]:
    """When four transfers end: two handed to the idle copier at 0, one at 0.5 ms in the idle
    direction while the first copies, one at 10 ms when all is done."""
    swapper = SimSwapper(LINK, block_nbytes=SHAPE.block_bytes(16), num_layers=2, pickup_s=pickup_s)
    ends: dict[int, float] = {}

    async def go() -> None:
        await _submit_at(swapper, 0.0, 1, "out")
        await _submit_at(swapper, 0.0, 2, "out")
        ends.update(swapper._end)
        await _submit_at(swapper, 0.0005, 3, "in")
        await _submit_at(swapper, 0.01, 4, "in")
        ends.update(swapper._end)

    trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))
    return ends


def test_the_sim_copier_wakes_up_for_a_transfer_that_finds_it_idle():
    plain = _ends(0.0)
    assert plain == pytest.approx({1: 0.001, 2: 0.002, 3: 0.0015, 4: 0.011})
    got = _ends(0.0003)
    assert got[1] == pytest.approx(0.0013)  # the first waits for the wake-up ...
    assert got[2] == pytest.approx(0.0023)  # ... and the one handed over with it queues behind
    assert got[3] == pytest.approx(0.0015)  # the copier was busy: no wake-up
    assert got[4] == pytest.approx(0.0113)  # idle again: another


def _waiting_step(engine: EngineCost, contention: CopyContention | None,
                  tickets: int) -> tuple[float, float, float]:
    """(seconds from 0 to the end of a decode step at 0 that waits for `tickets` swap-ins of
    1 ms each, handed over at 0, its stall, its compute seconds)."""
    runner = SimRunner(COST, 64, link=LINK, model=SHAPE, engine_cost=engine, contention=contention)
    seqs = (SeqWork(request_id=1, start=10, num_tokens=1, sample=True),)

    async def go() -> tuple[float, float, float]:
        swapper = await runner.make_swapper(16)
        for i in range(tickets):
            swapper.submit(i, "in", [(i, i)], "groups")
        done = await runner.step(ExecuteStep(step_id=1, release=(), setups=(), blocks=(), seqs=seqs,
                                             wait_tickets=tuple(range(tickets))))
        return trio.current_time(), done.stall_s, done.compute_s

    return trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_step_that_waited_pays_the_wake_up_and_the_swapped_in_charge():
    decode_s = COST.predict_ms(BatchShape(decode_seqs=1, decode_context=11)) / 1000
    plain = EngineCost(source="t")
    took, stall, compute = _waiting_step(plain, None, 1)
    assert stall == pytest.approx(0.001) and compute == pytest.approx(decode_s)
    hops = attrs.evolve(plain, copy_pickup_ms=0.3, wake_ms=0.04)
    charge = CopyContention(swapped_in_ms=0.2, source="t")
    took, stall, compute = _waiting_step(hops, charge, 2)
    assert stall == pytest.approx(0.0003 + 0.002 + 0.00004)  # wake-up, two 1 ms copies, wake
    assert compute == pytest.approx(decode_s + 2 * 0.0002)
    assert took == pytest.approx(stall + compute)
    took, stall, compute = _waiting_step(hops, charge, 0)  # nothing to wait for: neither
    assert stall == 0.0 and compute == pytest.approx(decode_s)


def test_a_fitted_profile_carries_the_hops_and_shipped_profiles_none(tiny_llama_dir, tmp_path):
    run = _copier_run()
    waited = attrs.evolve(run, steps=tuple(attrs.evolve(s, waited=1) for s in run.steps))
    cpu, fit = profile_from_runs(EngineConfig(model=tiny_llama_dir, device="cpu"), [waited],
                                 name="t", kv_cache_mib=8, gb_per_s=5.0, dispatch_us=5.0, source="t")
    assert cpu.engine_cost.copy_pickup_ms == pytest.approx(0.3)
    assert cpu.engine_cost.wake_ms == pytest.approx(0.04)
    assert cpu.copy_contention is not None
    assert cpu.copy_contention.swapped_in_ms == fit_swapped_in([waited], fit.cost)
    again = Profile.from_json(cpu.to_json(), "t")
    assert again.engine_cost == cpu.engine_cost and again.copy_contention == cpu.copy_contention
    shipped = load_profile("llama3-8b-a100")
    assert shipped.engine_cost is None and shipped.copy_contention is None
