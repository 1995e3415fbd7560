"""Slot-level KV copies for BROS's lazy checkpointing (§5.2, §6): a few KV slots of a block, every
layer's K and V, between the device arena and the host swap space, or within the arena.

Slots are flat addresses, `block * block_size + offset`, on both sides. Consecutive slots of one
block that land on consecutive slots of one block are one run, and a run is one strided copy
(`kv[block, :, :, first:first + n]`: every layer and K/V at once), so a checkpoint of s slots
costs at most s calls, never 2 * layers per block as a per-block swap does. Whole blocks that
are consecutive on both sides (a request swapped out whole, engine/memory/slot_swap.py) are one
run and one copy, as FastSwitch's block groups are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.memory.slot_runs import SlotDirection, slot_runs


def copy_slots(direction: SlotDirection, pairs: Sequence[tuple[int, int]], device_kv: torch.Tensor,
               host_kv: torch.Tensor) -> tuple[int, int]:
    """Run the copies; device_kv, host_kv: [blocks, L, 2, bs, H, D]. Returns (calls, bytes)."""
    bs = device_kv.shape[3]
    src_kv, dst_kv = {"out": (device_kv, host_kv), "in": (host_kv, device_kv),
                      "move": (device_kv, device_kv)}[direction]
    slot_nbytes = device_kv[0, :, :, 0].numel() * device_kv.element_size()
    calls = 0
    for s, d, n in slot_runs(pairs, bs):
        if n > bs:  # whole blocks, aligned on both sides: one contiguous copy (a block group)
            dst_kv[d // bs:(d + n) // bs].copy_(src_kv[s // bs:(s + n) // bs], non_blocking=True)
        else:
            src = src_kv[s // bs, :, :, s % bs:s % bs + n]  # [L, 2, n, H, D], strided
            dst_kv[d // bs, :, :, d % bs:d % bs + n].copy_(src, non_blocking=True)
        calls += 1
    return calls, len(pairs) * slot_nbytes
