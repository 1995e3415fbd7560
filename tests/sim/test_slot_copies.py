"""BROS's slot copies (lazy checkpoints, swap-backs, merges): what they cost in the simulator
(calls x dispatch + bytes / bandwidth, one call per run of consecutive slots, or one gather of
them at its own cost) and that the torch copier moves exactly those slots, every layer's K and
V, in as many calls (the gather itself: tests/gpu/test_slot_copy.py)."""

from __future__ import annotations

import pytest
import torch
import trio

from engine.cost_model import CostModel
from engine.memory.slot_runs import slot_blocks, slot_runs
from engine.messages import BlockUpdate, ExecuteStep, SeqWork
from gpu.slot_copy import copy_slots
from sim.profile import CopyLink, ModelShape
from sim.runner import SimRunner
from sim.swap import YIELD_MS, SimSwapper

BS = 4


def test_runs_merge_consecutive_slots_of_one_block_only():
    pairs = [(4, 8), (5, 9), (6, 10), (7, 12), (8, 13), (1, 2)]
    # 7 -> 12 breaks the destination run; 8 is in the next source block
    assert slot_runs(pairs, BS) == [(4, 8, 3), (7, 12, 1), (8, 13, 1), (1, 2, 1)]
    assert slot_blocks("out", pairs, BS) == ([0, 1, 2], [0, 2, 3])
    assert slot_blocks("move", [(4, 9)], BS) == ([1, 2], [])


@pytest.mark.trio
@pytest.mark.parametrize(("gather_calls", "calls"), [(None, 2), (3.0, 3), (6.0, 6)])
async def test_sim_charges_calls_times_dispatch_plus_bytes_over_bandwidth(autojump_clock,
                                                                           gather_calls, calls):
    """Two runs: two calls copied run by run, one gather charged `gather_calls` calls."""
    link = CopyLink(bandwidth_gb_per_s=1.0, dispatch_us=100.0)
    sw = SimSwapper(link, block_nbytes=4 * 10**6, num_layers=2, block_size=BS, yield_every=None,
                    yield_ms=None, slot_gather_calls=gather_calls)  # no bounded dispatch
    now = trio.current_time()
    sw.submit(1, "out", [(4, 0), (5, 1), (9, 7)], "slots")  # two runs, three slots of 1 MB
    end = now + calls * 100e-6 + 3e6 / 1e9
    assert sw.counters().copy_ops == (2 if gather_calls is None else 1)
    assert sw.gathers == (0 if gather_calls is None else 1)
    assert sw.overlapped_until([1], []) == pytest.approx(end)
    assert sw.overlapped_until([], [2]) == pytest.approx(end), "block 2 is busy"
    assert sw.ready_at([1], [2]) == 0.0, "slot copies overlap the step (BROS §4.1), never lead it"
    assert sw.slots == {"out": 3}
    await trio.sleep(0.01)
    assert sw.poll() == [1]


@pytest.mark.trio
@pytest.mark.parametrize("copy_slots_n", [1, 400])
async def test_a_step_overlapping_slot_copies_lasts_max_of_model_and_copies(autojump_clock,
                                                                           copy_slots_n):
    """BROS §4.1: iteration = max(model, swap). A step that writes a block being checkpointed
    and waits for that ticket runs beside the copy: short copies hide behind the model, long
    ones set the step's length (the excess counted as stall); never model + copies."""
    model = ModelShape(name="toy", num_layers=2, hidden_size=64, intermediate_size=128,
                       num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=500)
    cost = CostModel(a_ms=10.0, b_ms_per_prefill_token=0.0, c_ms_per_prefill_token_sq=0.0,
                     d_ms_per_decode_seq=0.0, e_ms_per_decode_context_token=0.0)  # 10 ms a step
    link = CopyLink(bandwidth_gb_per_s=0.001, dispatch_us=0.0)  # 1 MB/s: 512 B a slot
    runner = SimRunner(cost, 1000, link=link, model=model, block_size=BS)
    sw = await runner.make_swapper(100)
    pairs = [(BS * (10 + i // BS) + i % BS, i) for i in range(copy_slots_n)]
    sw.submit(7, "out", pairs, "slots")
    copy_s = copy_slots_n * model.block_bytes(BS) // BS / 1e6
    step = ExecuteStep(step_id=1, release=(), setups=(), wait_tickets=(7,),
                       blocks=(BlockUpdate(request_id=1, reset=True, append=(10,)),),
                       seqs=(SeqWork(request_id=1, start=0, num_tokens=1, sample=True),))
    began = trio.current_time()
    done = await runner.step(step)
    # the step's own token copy may wait one bounded-dispatch slice behind the checkpoints
    slack = YIELD_MS / 1000 + 1e-9
    assert max(0.010, copy_s) - 1e-9 <= trio.current_time() - began <= max(0.010, copy_s) + slack
    assert done.compute_s + done.stall_s == pytest.approx(trio.current_time() - began)


@pytest.mark.trio
async def test_a_block_group_is_its_own_call_beside_the_gather(autojump_clock):
    """A whole-block run (a block group) stays one contiguous copy; the partial runs beside it
    are one gather; a move onto its own sources is copied run by run."""
    link = CopyLink(bandwidth_gb_per_s=1000.0, dispatch_us=100.0)
    sw = SimSwapper(link, block_nbytes=4 * 10**6, num_layers=2, block_size=BS, yield_every=None,
                    yield_ms=None, slot_gather_calls=3.0)
    group = [(8 + i, 16 + i) for i in range(2 * BS)]  # blocks 2-3 -> host blocks 4-5
    sw.submit(1, "out", [(1, 0), *group, (5, 2)], "slots")
    assert (sw.counters().copy_ops, sw.gathers) == (2, 1)
    sw.submit(2, "move", [(0, 4), (4, 9)], "slots")  # 4 is read and written: no gather
    assert (sw.counters().copy_ops, sw.gathers) == (4, 1)


def test_torch_copier_moves_exactly_the_slots():
    gen = torch.Generator().manual_seed(0)
    device = torch.randn(3, 2, 2, BS, 2, 8, generator=gen)  # [blocks, L, k/v, slot, H, D]
    host = torch.full((2, 2, 2, BS, 2, 8), float("nan"))
    before = device.clone()
    calls, nbytes = copy_slots("out", [(5, 2), (6, 3), (11, 4)], device, host, gather=False)
    assert calls == 2 and nbytes == 3 * 2 * 2 * 2 * 8 * 4
    for dev_slot, host_slot in [(5, 2), (6, 3), (11, 4)]:
        torch.testing.assert_close(host[host_slot // BS, :, :, host_slot % BS],
                                   before[dev_slot // BS, :, :, dev_slot % BS])
    assert torch.isnan(host).sum() == host.numel() - 3 * 2 * 2 * 2 * 8, "only those slots"
    copy_slots("move", [(0, 9)], device, host)
    torch.testing.assert_close(device[2, :, :, 1], before[0, :, :, 0])
    copy_slots("in", [(2, 0)], device, host)
    torch.testing.assert_close(device[0, :, :, 0], before[1, :, :, 1])
