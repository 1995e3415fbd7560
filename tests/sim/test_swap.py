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
