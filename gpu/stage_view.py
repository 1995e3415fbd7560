"""Dropping a layer range from a loaded model, and viewing its arena again so that the freed
weight memory holds KV blocks (KunServe §4.1), without copying the KV it keeps.

The arena (gpu/arena.py) is block-major: old block b holds layer l's K and V at elements
[b*L*U + l*U, b*L*U + (l+1)*U), U = 2 * block_size * Hkv * D, and every layer's weights sit on
block boundaries. A member that keeps layers [a, a+k) needs only k*U elements per block. Its
stage view cuts the WHOLE buffer into blocks of stride k'*U, k' the smallest divisor of L that is
at least k, starting at (a mod k')*U: then old block b's kept layers are exactly stage block
b*L/k' + a//k', so the KV already there for those layers stays where it is and is read through
the new view (no copy). Every other stage block that does not overlap the weights still kept
(global tensors and the kept layers) is free for KV: the dropped layers' weights, the other
layers' KV of the old blocks, and the old blocks themselves, L/k' stage blocks to each.
The same holds between two stage views (a member re-split as its group grows or merges): a
block's layers lie at `base + l` in every view (`StageView.base`), and the new view serves the
KV there in place when it has a usable block at that base (`local_at`; gpu/kept_kv.py).

Dropping copies the dropped weights to host first (the copy restore and fault recovery use) and
zeroes the freed bytes; restoring writes weights back into their slots (from that host copy or
from a peer's kept range, one contiguous tensor per range) and returns to the full view.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import torch
from torch import nn

from gpu.arena import DeviceArena, plan_layout
from gpu.config import ModelConfig


def stride_layers(num_layers: int, kept: int) -> int:
    """k': the smallest divisor of `num_layers` that is at least `kept`."""
    if not 1 <= kept <= num_layers:
        raise ValueError(f"a stage keeps 1..{num_layers} layers, got {kept}")
    return next(d for d in range(kept, num_layers + 1) if num_layers % d == 0)


class StageView:
    """Block geometry of one arena re-viewed for a member keeping `keep` (no memory touched
    except through `layer_kv`)."""

    def __init__(self, config: ModelConfig, block_size: int, total_blocks: int,
                 weight_ranges: tuple[range, ...], keep: range) -> None:
        """`weight_ranges`: old-block ranges still holding weights (global tensors, kept
        layers)."""
        L = config.num_layers
        self.keep = keep
        self.unit = 2 * block_size * config.num_kv_heads * config.head_dim
        self.stride = stride_layers(L, len(keep))
        self.per_old = L // self.stride
        """Stage blocks per old block."""
        self.first = (keep.start % self.stride) * self.unit
        """Element where stage block 0 starts."""
        span = len(keep) * self.unit
        total = total_blocks * L * self.unit
        self.num_blocks = (total - self.first - span) // (self.stride * self.unit) + 1
        starts = self.first + np.arange(self.num_blocks, dtype=np.int64) * self.stride * self.unit
        usable = np.ones(self.num_blocks, dtype=bool)
        for r in weight_ranges:  # a stage block overlapping kept weights is not usable
            lo, hi = r.start * L * self.unit, r.stop * L * self.unit
            usable &= ~((starts < hi) & (starts + span > lo))
        self.usable = np.flatnonzero(usable)
        """Stage block ids free for KV (ascending)."""
        self._usable = usable

    @property
    def capacity(self) -> int:
        return len(self.usable)

    def local_of_old(self, old_block: int) -> int:
        """The stage block holding old block `old_block`'s kept layers."""
        return old_block * self.per_old + self.keep.start // self.stride

    def base(self, local: int) -> int:
        """Where layer 0 of stage block `local` would lie, in units of one layer's K and V of a
        block (U): its kept layer l lies at `base + l` (the full view's old block b: b*L)."""
        return (local - self.keep.start // self.stride) * self.stride

    def resplit_first(self) -> np.ndarray:
        """The usable blocks, those whose KV a later re-split to any smaller stride can keep
        in place first (their base a multiple of every divisor of the layer count below this
        stride: gpu/kept_kv.py), each part ascending: the order a block map hands them out."""
        L = self.per_old * self.stride
        step = math.lcm(*(d for d in range(1, self.stride) if L % d == 0)) \
            if self.stride > 1 else 1
        aligned = (self.usable - self.keep.start // self.stride) * self.stride % step == 0
        return np.concatenate((self.usable[aligned], self.usable[~aligned]))

    def local_at(self, base: int) -> int | None:
        """The usable stage block whose layers lie at `base + l` (l in `keep`), or None: none
        starts there (`base` is no multiple of the stride), or it overlaps kept weights or runs
        past the buffer. Another view's block of that base holds the same memory for the
        layers both keep: its KV is read here in place."""
        if base % self.stride:
            return None
        local = base // self.stride + self.keep.start // self.stride
        return local if 0 <= local < self.num_blocks and self._usable[local] else None

    def layer_kv(self, buffer: torch.Tensor, i: int, block_size: int, heads: int,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of kept layer i (0-based within `keep`), each
        [num_blocks, block_size, Hkv, D] strided over `buffer`."""
        size = (self.num_blocks, block_size, heads, head_dim)
        stride = (self.stride * self.unit, heads * head_dim, head_dim, 1)
        k_at = self.first + i * self.unit
        return (buffer.as_strided(size, stride, k_at),
                buffer.as_strided(size, stride, k_at + self.unit // 2))


def view_for(model, keep: range) -> StageView:
    """The stage view of `model`'s arena for a member keeping `keep` (geometry only)."""
    arena = model.arena
    return StageView(model.config, arena.block_size, arena.total_blocks,
                     kept_weight_ranges(arena.layout, keep), keep)


def group_pool_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype,
                      total_blocks: int, layers: tuple[range, ...]) -> int:
    """A group's block count: the smallest member capacity (one block space for all; every
    member has the same arena). Needs no model."""
    layout = plan_layout(config, block_size, dtype)
    return min(StageView(config, block_size, total_blocks, kept_weight_ranges(layout, keep),
                         keep).capacity for keep in layers)


def kept_weight_ranges(layout, keep: range) -> tuple[range, ...]:
    """Old-block ranges that still hold weights when `keep` is kept: the global tensors and
    the kept layers' blocks."""
    return (layout.global_blocks,
            range(layout.layer_blocks[keep.start].start, layout.layer_blocks[keep.stop - 1].stop))


def dropped_ranges(layout, num_layers: int, keep: range) -> tuple[tuple[range, range], ...]:
    """(layers, old blocks) of each contiguous dropped range (before and after `keep`)."""
    out = []
    for layers in (range(keep.start), range(keep.stop, num_layers)):
        if len(layers):
            out.append((layers, range(layout.layer_blocks[layers.start].start,
                                      layout.layer_blocks[layers.stop - 1].stop)))
    return tuple(out)


@attrs.define(eq=False)
class DropState:
    """What a dropped model remembers to restore itself."""

    keep: range
    view: StageView
    all_layers: nn.ModuleList
    host_copy: dict[tuple[int, int], torch.Tensor]
    """(first, stop) old block range -> its weights on host, taken at the drop."""
    freed_bytes: int


def elem_range(arena: DeviceArena, blocks: range) -> slice:
    per = arena.layout.block_elems
    return slice(blocks.start * per, blocks.stop * per)


def drop_layers(model, keep: range) -> DropState:
    """Make the loaded full model `model` (CausalLM) a stage keeping `keep`, in place."""
    arena: DeviceArena = model.arena
    L = model.config.num_layers
    if getattr(model, "drop_state", None) is not None:
        raise RuntimeError(f"layers already dropped (keeping {model.drop_state.keep})")
    if keep.step != 1 or not 0 <= keep.start < keep.stop <= L:
        raise ValueError(f"keep must be a contiguous range within 0..{L}, got {keep}")
    layout = arena.layout
    view = StageView(model.config, arena.block_size, arena.total_blocks,
                     kept_weight_ranges(layout, keep), keep)
    host, freed = {}, 0
    pin = arena.device.type == "cuda"
    for _, blocks in dropped_ranges(layout, L, keep):
        part = arena.buffer[elem_range(arena, blocks)]
        host[(blocks.start, blocks.stop)] = part.to("cpu", copy=True).pin_memory() if pin \
            else part.clone()
        part.zero_()
        freed += part.numel() * part.element_size()
    state = DropState(keep=keep, view=view, all_layers=model.model.layers, host_copy=host,
                      freed_bytes=freed)
    serve_stage(model, state)
    return state


def serve_stage(model, state: DropState) -> None:
    """The model serves `state.keep` over `state.view`: its layer list, each layer's index
    into its KV, its KV tensors, and whether it is the first and the last stage."""
    keep, view, arena, c = state.keep, state.view, model.arena, model.config
    model.model.layers = nn.ModuleList(state.all_layers[i] for i in keep)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.layer = i
    model._kv = tuple(view.layer_kv(arena.buffer, i, arena.block_size, c.num_kv_heads,
                                    c.head_dim) for i in range(len(keep)))
    model.first_stage, model.last_stage = keep.start == 0, keep.stop == c.num_layers
    model.drop_state = state


def restore_layers(model, fill=None) -> None:
    """Write the dropped weights back and return to the full view. `fill(blocks, dst)` writes
    old block range `blocks` of weights into `dst` (a peer's copy received over the network);
    None: from the host copy taken at the drop."""
    state: DropState | None = getattr(model, "drop_state", None)
    if state is None:
        raise RuntimeError("no layers are dropped")
    arena: DeviceArena = model.arena
    if fill is None:  # the host copy may be in pieces (a grown group's: gpu/group_grow.py)
        for (first, stop), saved in state.host_copy.items():
            arena.buffer[elem_range(arena, range(first, stop))].copy_(saved, non_blocking=False)
    else:  # whole dropped ranges: a peer's kept range lies within one
        for _, blocks in dropped_ranges(arena.layout, model.config.num_layers, state.keep):
            fill(blocks, arena.buffer[elem_range(arena, blocks)])
    model.model.layers = state.all_layers
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.layer = i
    model._kv = tuple(arena.layer_kv(i) for i in range(model.config.num_layers))
    model.first_stage = model.last_stage = True
    model.drop_state = None


def gained(start) -> list[tuple[int, range]]:
    """(old member, layers) it keeps now and held no weights of (a growing group's re-split;
    `start`: its `GroupStart`, gpu/group_stage.py)."""
    out = []
    for k, h in enumerate(start.held):
        if len(h):
            keep = start.layers[k]
            out += [(k, r) for r in (range(keep.start, min(keep.stop, h.start)),
                                     range(max(keep.start, h.stop), keep.stop)) if len(r)]
    return out


def send_gained(plane, model, start) -> int:
    """This member (it holds every layer) sends each old member the weights of the layers it
    gains, and waits until they went (it drops its own next). Returns the bytes sent."""
    from gpu.data_plane import WEIGHTS_TAG

    arena, sent = model.arena, 0
    lb = arena.layout.layer_blocks
    for k, run in gained(start):
        part = arena.buffer[elem_range(arena, range(lb[run.start].start, lb[run.stop - 1].stop))]
        plane.queue.put(part, dst=start.ranks[k], tag=WEIGHTS_TAG, kind="kv")
        sent += part.numel() * part.element_size()
    try:
        plane.queue.flush()
    except RuntimeError as exc:  # the sending thread failed: a receiver went away
        from gpu.data_plane import GroupMemberLost

        raise GroupMemberLost(-1, "the layers its members gain were being sent", exc) from exc
    return sent


def redrop_layers(model, keep: range, fill=None) -> tuple[DropState, int, int]:
    """A dropped model keeps `keep` instead of the range it keeps now, copying only what
    changes: the layers it gains come back from its host copy (or `fill(blocks, dst)`: a peer's
    copy received into place, each contiguous run of them at once), the layers it drops now go
    to the host; the host copy of a layer dropped before and after stays as it is (a slice of
    it, not a copy: the host copy is then in pieces). Returns the new state, the bytes written
    back and the bytes saved to the host. KV of the old view where the gained weights go is
    overwritten (gpu/kept_kv.py takes what cannot stay in place first)."""
    state: DropState = model.drop_state
    arena, L = model.arena, model.config.num_layers
    layout, per = arena.layout, arena.layout.block_elems
    if keep.step != 1 or not 0 <= keep.start < keep.stop <= L:
        raise ValueError(f"keep must be a contiguous range within 0..{L}, got {keep}")

    def span(layers: range) -> range:
        return range(layout.layer_blocks[layers.start].start,
                     layout.layer_blocks[layers.stop - 1].stop)

    def held(blocks: range) -> torch.Tensor:  # the host copy's elements of `blocks` (a view)
        for (first, stop), saved in state.host_copy.items():
            if first <= blocks.start and blocks.stop <= stop:
                return saved[(blocks.start - first) * per:(blocks.stop - first) * per]
        raise KeyError(f"blocks {blocks} are in no host copy of the dropped layers")

    restored = saved_bytes = freed = 0
    for run in _runs(keep, lambda i: i in state.keep):
        if run.start not in state.keep and fill is not None:  # gained: from a peer
            fill(span(run), arena.buffer[elem_range(arena, span(run))])
        elif run.start not in state.keep:  # gained: back from the host copy
            src = held(span(run))
            arena.buffer[elem_range(arena, span(run))].copy_(src)
            restored += src.numel() * src.element_size()
    host = {}
    pin = arena.device.type == "cuda"
    for layers, _ in dropped_ranges(layout, L, keep):
        for run in _runs(layers, lambda i: i in state.keep):
            b = span(run)
            part = arena.buffer[elem_range(arena, b)]
            freed += part.numel() * part.element_size()
            if run.start in state.keep:  # dropped now: to the host, then freed
                host[(b.start, b.stop)] = part.to("cpu", copy=True).pin_memory() if pin \
                    else part.clone()
                part.zero_()
                saved_bytes += part.numel() * part.element_size()
            else:
                host[(b.start, b.stop)] = held(b)
    view = view_for(model, keep)
    new = DropState(keep=keep, view=view, all_layers=state.all_layers, host_copy=host,
                    freed_bytes=freed)
    serve_stage(model, new)
    return new, restored, saved_bytes


def _runs(layers: range, key) -> list[range]:
    """`layers` cut into maximal runs on which `key` does not change."""
    out: list[range] = []
    for i in layers:
        if out and key(i) == key(out[-1].start) and out[-1].stop == i:
            out[-1] = range(out[-1].start, i + 1)
        else:
            out.append(range(i, i + 1))
    return out
