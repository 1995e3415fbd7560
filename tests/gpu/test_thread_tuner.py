"""The thread tuner moves to the thread count whose steps are faster, and only then."""

from __future__ import annotations

import itertools

import pytest

from engine.config import EngineConfig
from gpu.config import ModelConfig
from gpu.runner import TorchRunner
from gpu.thread_tuner import ThreadTuner, thread_candidates


def serve(tuner: ThreadTuner, seconds_at: dict[int, float], steps: int,
          shape: object = ("decode", 8)) -> list[int]:
    """Run `steps` steps of one shape whose time depends only on the thread count; returns the
    count each step ran at."""
    ran = []
    for _ in range(steps):
        tuner.begin(shape)
        ran.append(tuner._running)
        tuner.end(seconds_at[tuner._running])
    return ran


def make_tuner(**overrides) -> tuple[ThreadTuner, list[int]]:
    calls: list[int] = []
    kw = {"min_interval": 50, "max_interval": 50, "first_probe": 2, "pairs": 4,
          "margin": 0.1} | overrides
    return ThreadTuner((2, 1), calls.append, **kw), calls


def test_candidates_are_all_cores_half_and_one():
    assert thread_candidates(1) == (1,)
    assert thread_candidates(2) == (2, 1)
    assert thread_candidates(16) == (16, 8, 1)


QUIET = {2: 0.006, 1: 0.0102}  # a model big enough that two threads pay, on a quiet machine
BUSY = {2: 0.0235, 1: 0.0102}  # one core taken by another process: two threads held up


def test_starts_at_all_cores_and_keeps_them_where_they_are_faster():
    tuner, _ = make_tuner()
    ran = serve(tuner, QUIET, steps=200)
    assert ran[0] == 2 and tuner.current == 2 and tuner.switches == []
    assert tuner.probes >= 3


def test_moves_to_one_thread_within_a_few_steps_next_to_a_busy_process():
    tuner, _ = make_tuner()
    ran = serve(tuner, BUSY, steps=60)
    assert tuner.current == 1 and ran.index(1) <= 5
    assert [(s.before, s.after) for s in tuner.switches] == [(2, 1)]
    assert tuner.switches[0].ratio == pytest.approx(0.0102 / 0.0235)
    assert ran[6:].count(2) <= 2  # later probes: one lopsided pair each


def test_stays_when_the_other_count_is_slower_or_within_the_margin():
    for one_thread in (0.015, 0.0095):  # 1.5x slower; 5% faster, inside the 10% margin
        tuner, _ = make_tuner()
        serve(tuner, {2: 0.01, 1: one_thread}, steps=200)
        assert tuner.current == 2 and tuner.switches == []
        assert tuner.probes >= 3


def test_goes_back_when_the_competitor_leaves():
    tuner, _ = make_tuner()
    serve(tuner, BUSY, steps=40)
    serve(tuner, QUIET, steps=120)
    assert [(s.before, s.after) for s in tuner.switches] == [(2, 1), (1, 2)]


def test_probes_cost_at_most_their_pairs():
    tuner, _ = make_tuner(min_interval=100, max_interval=100, first_probe=100)
    ran = serve(tuner, {2: 0.01, 1: 0.015}, steps=1000)
    off = sum(1 for t in ran if t != 2)
    assert tuner.probes == 9  # steps 100, ~208, ... (each probe takes 8 steps)
    assert off == 4 * tuner.probes


def test_a_lopsided_pair_ends_the_probe_at_once():
    """Next to a busy process a 2-thread step took 10x as long here: one pair says enough."""
    tuner, _ = make_tuner(min_interval=100, max_interval=100, first_probe=100)
    serve(tuner, {2: 0.1, 1: 0.01}, steps=1)  # at 2 threads until the first probe
    ran = serve(tuner, {2: 0.1, 1: 0.01}, steps=999)
    assert tuner.switches[0].step == 101  # the first probe: one pair, then one thread
    assert tuner.probes == 9 and sum(1 for t in ran[101:] if t != 1) == tuner.probes - 1


def test_intervals_double_while_the_choice_holds():
    tuner, _ = make_tuner(min_interval=10, max_interval=40, first_probe=1)
    starts = []
    for _ in range(200):
        probing = tuner._probe is not None
        serve(tuner, {2: 0.01, 1: 0.015}, steps=1)
        if tuner._probe is not None and not probing:
            starts.append(tuner._steps)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # a probe spans 8 steps; the interval after it doubles from 10 (20, 40, then 40 at most)
    assert gaps[:2] == [7 + 20, 7 + 40] and set(gaps[2:]) == {7 + 40}


def test_a_competitor_arriving_mid_run_is_caught_before_the_next_interval():
    """Steps turning 2.35x slower (a busy process took a core) start a probe at once instead of
    after the rest of a long interval."""
    tuner, _ = make_tuner(min_interval=32, max_interval=256, first_probe=1)
    serve(tuner, {2: 0.0085, 1: 0.0102}, steps=600)  # quiet: two threads 1.2x faster
    assert tuner.current == 2
    ran = serve(tuner, BUSY, steps=40)
    assert tuner.current == 1 and ran.index(1) <= 4


def test_pairs_only_steps_of_the_same_shape():
    """A pair whose two steps differ in shape says nothing about the thread count: a tuner that
    paired a big prefill at 2 threads with a small decode at 1 would switch wrongly."""
    tuner, _ = make_tuner(first_probe=1, patience=20)
    for i in range(30):
        shape = ("prefill", 512) if i % 2 == 0 else ("decode", 1)
        tuner.begin(shape)
        # the big step takes long whatever the count; 1 thread is 1.5x slower on either
        base = 0.1 if shape[0] == "prefill" else 0.001
        tuner.end(base * (1.5 if tuner._running == 1 else 1.0))
    assert tuner.current == 2 and tuner.switches == []
    assert tuner.probes == 1  # the probe ran out of patience with no pair


def test_one_candidate_never_probes():
    calls: list[int] = []
    tuner = ThreadTuner((1,), calls.append, first_probe=1)
    serve(tuner, {1: 0.01}, steps=50)
    assert calls == [1] and tuner.probes == 0


def test_runner_tunes_only_when_no_count_was_given(tiny_llama_dir):
    model = ModelConfig.from_dir(tiny_llama_dir)
    chosen = TorchRunner(EngineConfig(model=tiny_llama_dir, device="cpu"), model, 8)
    fixed = TorchRunner(EngineConfig(model=tiny_llama_dir, device="cpu", threads=1), model, 8)
    try:
        chosen._thread.call(chosen._load)
        fixed._thread.call(fixed._load)
        assert chosen.thread_tuner is not None and fixed.thread_tuner is None
    finally:
        chosen.close()
        fixed.close()
