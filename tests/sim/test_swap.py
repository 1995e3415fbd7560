"""The simulator's swapper: modelled copies, and the conflict waits a step pays for them."""

from __future__ import annotations

import pytest
import trio

from sim.profile import CopyLink
from sim.swap import SimSwapper

pytestmark = pytest.mark.trio

BLOCK = 10**6
"""Bytes a block holds: 1 ms over the 1 GB/s link below."""


def make_swapper() -> SimSwapper:
    return SimSwapper(CopyLink(bandwidth_gb_per_s=1.0, dispatch_us=0.0), block_nbytes=BLOCK,
                      num_layers=2)


async def test_a_step_writing_a_block_a_swap_out_reads_waits_for_it(autojump_clock):
    sw = make_swapper()
    now = trio.current_time()
    sw.submit(1, "out", [(2, 0), (3, 1)], "groups")          # ends 2 ms from now
    assert sw.ready_at([], [3]) == pytest.approx(now + 0.002)
    assert sw.ready_at([], [4, 5]) <= now                      # other blocks: no wait
    await trio.sleep(0.002)
    assert sw.poll() == [1]
    assert sw.ready_at([], [3]) <= trio.current_time()


async def test_a_step_waits_for_its_sync_swap_ins_behind_earlier_copies(autojump_clock):
    sw = make_swapper()
    now = trio.current_time()
    sw.submit(1, "in", [(2, 0)], "groups")                   # ends at +1 ms
    sw.submit(2, "in", [(5, 1)], "groups")                   # queued behind it: +2 ms
    assert sw.ready_at([2], []) == pytest.approx(now + 0.002)
    assert sw.next_poll_s() == pytest.approx(0.001)


async def test_copies_are_counted_per_call_and_block(autojump_clock):
    sw = make_swapper()
    sw.submit(1, "out", [(2, 0), (3, 1), (7, 2)], "groups")  # two runs
    sw.submit(2, "in", [(2, 0)], "per-block")                # 2 layers x K/V
    c = sw.counters()
    assert (c.copy_ops, c.blocks_out, c.blocks_in) == (2 + 4, 3, 1)
    assert (c.bytes_out, c.bytes_in) == (3 * BLOCK, BLOCK)



@pytest.mark.parametrize(("yield_every", "wait_ms", "end_ms", "yields"),
                         [(None, 11.0, 11.0, 0), (2, 2.2, 11.4, 5)])
async def test_bounded_dispatch_lets_a_steps_own_copy_in_at_the_next_synchronisation(
        autojump_clock, yield_every, wait_ms, end_ms, yields):
    """Issue 13, defect 4 (FastSwitch §3.2): after `yield_every` dispatched copies the swapper
    synchronises, so a step's own copy waits for at most that many of ours, not all of them;
    each synchronisation is counted and costs one more dispatch."""
    link = CopyLink(bandwidth_gb_per_s=1.0, dispatch_us=100.0)
    sw = SimSwapper(link, block_nbytes=BLOCK, num_layers=2, yield_every=yield_every,
                    yield_ms=None)
    now = trio.current_time()
    sw.submit(1, "in", [(b * 2, b) for b in range(10)], "groups")  # 10 copies of 1.1 ms
    assert sw.engine.step_copy(now, "in") == pytest.approx(wait_ms / 1000)
    assert sw.engine.step_copy(now, "out") == 0.0                   # the other direction is idle
    c = sw.counters()
    assert (c.yields, c.runs, c.copy_ops) == (yields, 10, 10)
    assert c.step_copy_wait_s == pytest.approx(wait_ms / 1000)
    assert sw.next_poll_s() == pytest.approx(end_ms / 1000)


async def test_a_single_large_group_copy_is_issued_in_bounded_pieces(autojump_clock):
    """One group of 10 blocks is one call in our layout; bounded to 3 ms of copying (3 MB at
    1 GB/s) it goes in 4 pieces of 2.5 MB (3 extra calls), and a step's copy waits for one."""
    link = CopyLink(bandwidth_gb_per_s=1.0, dispatch_us=100.0)
    sw = SimSwapper(link, block_nbytes=BLOCK, num_layers=2, yield_every=256,
                    yield_ms=3.0)
    now = trio.current_time()
    sw.submit(1, "in", [(b, b) for b in range(10)], "groups")
    piece_ms = 0.1 + 2.5
    assert sw.engine.step_copy(now, "in") == pytest.approx(piece_ms / 1000)
    c = sw.counters()
    assert (c.runs, c.copy_ops, c.yields) == (1, 4, 4)
    assert sw.next_poll_s() == pytest.approx((4 * piece_ms + 3 * 0.1) / 1000)
