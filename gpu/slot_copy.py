"""Slot-level KV copies for BROS's lazy checkpointing (§5.2, §6): a few KV slots of a block, every
layer's K and V, between the device arena and the host swap space, or within the arena.

Slots are flat addresses, `block * block_size + offset`, on both sides. Consecutive slots of one
block that land on consecutive slots of one block are one run (engine/memory/slot_runs.py).
Whole blocks that are consecutive on both sides (a request swapped out whole,
engine/memory/slot_swap.py) are one run and one contiguous copy, as FastSwitch's block groups are.

Two kinds of copy for the rest (`gather`):
- runs (`gather=False`): one strided copy per run (`kv[block, :, :, first:first + n]`: every
  layer and K/V at once), so s slots in r runs cost r calls;
- a gather (`gather=True`, the default): every slot of every such run, across blocks, in one
  indexed copy: one gather on the source side into a contiguous [slots, L, 2, H, D] tensor and
  one scatter on the destination side (`index` / `index_put_`). One step's checkpoints, which
  RT takes one slot a block a decode step (a run of one each), go out in one call instead of one
  per slot. BROS §6 does this with its own CUDA kernels ("fetch and store KV caches in
  non-continuous GPU memory"); here it is torch's indexing: on CUDA the index upload, one gather
  kernel on the copy stream and one device -> host copy (the host side is then written on the
  CPU, `.to` waiting for the copy), or the reverse for a swap-in. The CPU path is the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.memory.slot_runs import SlotDirection, moves_onto_sources, slot_runs


def copy_slots(direction: SlotDirection, pairs: Sequence[tuple[int, int]], device_kv: torch.Tensor,
               host_kv: torch.Tensor, *, gather: bool = True) -> tuple[int, int]:
    """Run the copies; device_kv, host_kv: [blocks, L, 2, bs, H, D]. Returns (calls, bytes)."""
    bs = device_kv.shape[3]
    src_kv, dst_kv = {"out": (device_kv, host_kv), "in": (host_kv, device_kv),
                      "move": (device_kv, device_kv)}[direction]
    slot_nbytes = device_kv[0, :, :, 0].numel() * device_kv.element_size()
    runs = slot_runs(pairs, bs)
    gather = gather and not moves_onto_sources(direction, pairs)
    scattered: list[tuple[int, int, int]] = []
    calls = 0
    for s, d, n in runs:
        if n > bs:  # whole blocks, aligned on both sides: one contiguous copy (a block group)
            dst_kv[d // bs:(d + n) // bs].copy_(src_kv[s // bs:(s + n) // bs], non_blocking=True)
            calls += 1
        elif gather:
            scattered.append((s, d, n))
        else:
            _copy_run(src_kv, dst_kv, s, d, n)
            calls += 1
    if len(scattered) == 1:  # one run: a strided copy is already one call
        _copy_run(src_kv, dst_kv, *scattered[0])
        calls += 1
    elif scattered:
        gather_slots(src_kv, dst_kv, scattered)
        calls += 1
    return calls, len(pairs) * slot_nbytes


def _copy_run(src_kv: torch.Tensor, dst_kv: torch.Tensor, s: int, d: int, n: int) -> None:
    bs = src_kv.shape[3]
    src = src_kv[s // bs, :, :, s % bs:s % bs + n]  # [L, 2, n, H, D], strided
    dst_kv[d // bs, :, :, d % bs:d % bs + n].copy_(src, non_blocking=True)


def gather_slots(src_kv: torch.Tensor, dst_kv: torch.Tensor,
                 runs: Sequence[tuple[int, int, int]]) -> None:
    """Copy the slots of `runs` ((first source slot, first destination slot, length), each within
    one block on both sides) in one gather and one scatter. Every source slot is read before any
    destination slot is written, so no destination may be a source (the caller checks moves)."""
    bs = src_kv.shape[3]
    src = torch.tensor([s + i for s, _, n in runs for i in range(n)], device=src_kv.device)
    dst = torch.tensor([d + i for _, d, n in runs for i in range(n)], device=dst_kv.device)
    slots = src_kv[src // bs, :, :, src % bs]  # [n, L, 2, H, D]: the gather
    dst_kv[dst // bs, :, :, dst % bs] = slots.to(dst_kv.device)  # the scatter
