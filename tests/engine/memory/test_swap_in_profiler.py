"""Adaptive swap-in (FastSwitch §3.2): sync when the predicted stall is a small share of an
iteration, async when it is not (or cannot be predicted yet); `sync`/`async` as written."""

from __future__ import annotations

import pytest

from engine.memory.swap_in_profiler import SYNC_SWAP_IN_SHARE, SwapInProfiler
from engine.messages import SwapIn
from tests.factories import make_view, running


def swapped(blocks: int, **overrides: object):
    return make_view(state="swapped", swapped_blocks=blocks, computed_tokens=blocks * 4,
                     **overrides)


def profiler(seconds_per_block: float | None) -> SwapInProfiler:
    p = SwapInProfiler()
    p.observe(seconds_per_block)
    return p


def test_a_small_predicted_stall_swaps_in_synchronously_a_large_one_asynchronously():
    p = profiler(0.001)                                   # 1 ms per block, 20 ms iterations
    assert SYNC_SWAP_IN_SHARE * 20.0 == 10.0              # the line: 10 ms of stall
    assert p.asynchronous("adaptive", [swapped(4)], max_num_seqs=8, iteration_ms=20.0) is False
    assert p.asynchronous("adaptive", [swapped(8), swapped(4)], max_num_seqs=8,
                          iteration_ms=20.0) is True      # 12 ms > 10 ms
    assert p.asynchronous("adaptive", [swapped(12)], max_num_seqs=8, iteration_ms=40.0) is False


def test_only_swapped_requests_that_could_run_now_count():
    p = profiler(0.001)
    order = [running(1, 4), swapped(3), swapped(50)]      # the 50-block one is past the batch
    assert p.asynchronous("adaptive", order, max_num_seqs=2, iteration_ms=20.0) is False
    assert p.asynchronous("adaptive", order, max_num_seqs=3, iteration_ms=20.0) is True


def test_only_the_swap_ins_that_fit_in_free_blocks_count():
    """Issue 13, defect 3: with many swapped requests in the head of the order, all of them were
    counted though only those that fit come back now, so adaptive always went asynchronous."""
    p = profiler(0.001)
    many = [swapped(5) for _ in range(40)]                # 200 ms if all came back at once
    assert p.asynchronous("adaptive", many, max_num_seqs=64, iteration_ms=40.0,
                          free_blocks=12) is False        # two fit: 10 ms <= 20 ms
    assert p.asynchronous("adaptive", many, max_num_seqs=64, iteration_ms=40.0,
                          free_blocks=30) is True         # six fit: 30 ms
    assert p.asynchronous("adaptive", many, max_num_seqs=64, iteration_ms=40.0,
                          free_blocks=0) is False         # the first comes back by eviction


def test_without_a_measurement_or_an_iteration_time_it_goes_asynchronous():
    assert profiler(None).asynchronous("adaptive", [swapped(1)], max_num_seqs=8,
                                       iteration_ms=20.0) is True
    assert profiler(1e-9).asynchronous("adaptive", [swapped(1)], max_num_seqs=8,
                                       iteration_ms=0.0) is True


@pytest.mark.parametrize(("mode", "expected"), [("sync", False), ("async", True)])
def test_fixed_modes_ignore_the_profile(mode, expected):
    for p in (profiler(None), profiler(0.001), profiler(10.0)):
        assert p.asynchronous(mode, [swapped(4)], max_num_seqs=8, iteration_ms=20.0) is expected


@pytest.mark.parametrize("mode", ["sync", "async", "adaptive"])
def test_nothing_swapped_means_nothing_to_swap_in_asynchronously(mode):
    p = profiler(10.0)
    assert p.asynchronous(mode, [running(1, 4), make_view()], max_num_seqs=8,
                          iteration_ms=20.0) is False


def test_the_rate_is_a_running_mean_that_ignores_empty_reports():
    p = profiler(1.0)
    p.observe(None)
    assert p.seconds_per_block == 1.0
    p.observe(2.0)
    assert p.seconds_per_block == pytest.approx(1.2)


def test_choices_are_counted_and_taken():
    p = SwapInProfiler()
    p.count([SwapIn(request_id=1, cpu_blocks=(0,), sync=True),
             SwapIn(request_id=2, cpu_blocks=(1,), sync=False),
             SwapIn(request_id=3, cpu_blocks=(2,), sync=False)])
    taken = p.take_counters()
    assert (taken.sync_swap_ins, taken.async_swap_ins) == (1, 2)
    assert (p.sync_swap_ins, p.async_swap_ins) == (0, 0)
