"""BROS's slot copies (lazy checkpoints, swap-backs, merges): what they cost in the simulator
(calls x dispatch + bytes / bandwidth, one call per run of consecutive slots) and that the torch
copier moves exactly those slots, every layer's K and V, in as many calls."""

from __future__ import annotations

import pytest
import torch
import trio

from engine.memory.slot_runs import slot_blocks, slot_runs
from gpu.slot_copy import copy_slots
from sim.profile import CopyLink
from sim.swap import SimSwapper

BS = 4


def test_runs_merge_consecutive_slots_of_one_block_only():
    pairs = [(4, 8), (5, 9), (6, 10), (7, 12), (8, 13), (1, 2)]
    # 7 -> 12 breaks the destination run; 8 is in the next source block
    assert slot_runs(pairs, BS) == [(4, 8, 3), (7, 12, 1), (8, 13, 1), (1, 2, 1)]
    assert slot_blocks("out", pairs, BS) == ([0, 1, 2], [0, 2, 3])
    assert slot_blocks("move", [(4, 9)], BS) == ([1, 2], [])


@pytest.mark.trio
async def test_sim_charges_calls_times_dispatch_plus_bytes_over_bandwidth(autojump_clock):
    link = CopyLink(bandwidth_gb_per_s=1.0, dispatch_us=100.0)
    sw = SimSwapper(link, block_nbytes=4 * 10**6, num_layers=2, block_size=BS, yield_every=None,
                    yield_ms=None)  # no bounded dispatch: the bare cost
    now = trio.current_time()
    sw.submit(1, "out", [(4, 0), (5, 1), (9, 7)], "slots")  # two runs, three slots of 1 MB
    assert sw.ready_at([1], []) == pytest.approx(now + 2 * 100e-6 + 3e6 / 1e9)
    assert sw.ready_at([], [2]) == pytest.approx(now + 2 * 100e-6 + 3e6 / 1e9), "block 2 is busy"
    assert sw.slots == {"out": 3}
    await trio.sleep(0.01)
    assert sw.poll() == [1]


def test_torch_copier_moves_exactly_the_slots():
    gen = torch.Generator().manual_seed(0)
    device = torch.randn(3, 2, 2, BS, 2, 8, generator=gen)  # [blocks, L, k/v, slot, H, D]
    host = torch.full((2, 2, 2, BS, 2, 8), float("nan"))
    before = device.clone()
    calls, nbytes = copy_slots("out", [(5, 2), (6, 3), (11, 4)], device, host)
    assert calls == 2 and nbytes == 3 * 2 * 2 * 2 * 8 * 4
    for dev_slot, host_slot in [(5, 2), (6, 3), (11, 4)]:
        torch.testing.assert_close(host[host_slot // BS, :, :, host_slot % BS],
                                   before[dev_slot // BS, :, :, dev_slot % BS])
    assert torch.isnan(host).sum() == host.numel() - 3 * 2 * 2 * 2 * 8, "only those slots"
    copy_slots("move", [(0, 9)], device, host)
    torch.testing.assert_close(device[2, :, :, 1], before[0, :, :, 0])
    copy_slots("in", [(2, 0)], device, host)
    torch.testing.assert_close(device[0, :, :, 0], before[1, :, :, 1])
