"""A member's kept KV across a re-split (a running group grows, gpu/group_grow.py, or merges,
gpu/group_merge.py): the KV of the layers it keeps of those it held stays where it lies and is
read through the new stage view, with no copy, wherever the layout allows it.

Stage view geometry (gpu/stage_view.py): in units U of one layer's K and V of a block, a view
keeping `keep` with stride s puts layer l of its stage block j at `base(j) + l`, base(j) a
multiple of s. A block of the old view (stride s1) holds the layers both views keep at
`base1 + l`; the new view (stride s2) has a block there exactly when s2 divides base1, and it
may serve it when that block overlaps no weight still kept (the gained layers' weights come
back into their blocks) and lies inside the buffer (`StageView.local_at`). Then the block is
the new view's, pinned (or reserved) for the group id (or the request) whose KV it holds.

The copy stays where this layout allows no such block, and counted:
- s2 does not divide base1: the strides are the smallest divisors of the layer count at least
  the layers kept (gpu/stage_view.py `stride_layers`), so with a layer count whose divisors do
  not divide each other (6 layers kept 3 | 3, then 2 | 2 | 2: strides 3, then 2) every other
  old block lies across two new ones; with a power of two (every divisor divides the larger
  ones) and a re-split that keeps no more layers than before, none does;
- the block it would be overlaps the weights of a layer the member gains, or the global ones;
- an old block shared by two requests handed over in a merge (a shared prefix block): the
  first keeps it, each other gets its own copy (their new tables need not share it).
Those blocks' kept layers are gathered on the device before anything is overwritten (the
gained weights, other blocks' chunks) and written into fresh blocks once the new map exists:
a device copy (on a GPU no host round trip either).

The head's kept KV at a restore's step (gpu/restore_kv.py): `own_moves` finds the blocks not
where their solo blocks' layers lie, `place_own` copies them there inside the arena.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from gpu.block_map import copy_order
from gpu.group_messages import overlap
from gpu.stage_view import view_for

IN_PLACE = True
"""False: every kept block is copied (the path before in-place re-splits; tests compare)."""


class KeptKV:
    """Made before the re-split (the model still serves its old range): which old stage
    blocks' kept layers stay in place (`in_place`: old block -> new block) and a device copy of
    the others' (`copy_of`). `old_blocks` may repeat a block (shared by two requests): its
    first use may stay in place, the others take a copy."""

    def __init__(self, model, keep: range, old_blocks: Sequence[int]) -> None:
        state = model.drop_state
        was = state.keep
        self.stay = overlap(was, keep)
        """The layers both ranges keep."""
        c, arena = model.config, model.arena
        self.block_bytes = (len(self.stay) * 2 * arena.block_size * c.num_kv_heads * c.head_dim
                            * arena.buffer.element_size())
        """Bytes of one block's kept layers."""
        self.in_place: dict[int, int] = {}
        self._copies: dict[int, int] = {}
        self._used: set[int] = set()
        self._data: torch.Tensor | None = None
        self.copied_bytes = 0
        """Kept KV copied (what could not stay in place)."""
        self.in_place_bytes = 0
        """Kept KV left where it lies."""
        if not len(self.stay):
            return
        old, new = state.view, view_for(model, keep)
        uses = Counter(old_blocks)
        for b in uses:
            j = new.local_at(old.base(b)) if IN_PLACE else None
            if j is not None:
                self.in_place[b] = j
        gather = [b for b, n in uses.items() if b not in self.in_place or n > 1]
        self._copies = {b: i for i, b in enumerate(gather)}
        if gather:  # [blocks, kept layers, 2, bs, H, D], on the device
            idx = torch.tensor(gather, device=arena.device)
            first = self.stay.start - was.start
            self._data = torch.stack([torch.stack((k[idx], v[idx]), dim=1) for k, v in
                                      model._kv[first:first + len(self.stay)]], dim=1)

    def place(self, old_block: int) -> int | None:
        """The new block for one use of `old_block`: where it lies (its first use, when the
        layout allows), or None: it takes a copy (`write_copy` once it has a block)."""
        if not len(self.stay):
            return None
        j = self.in_place.get(old_block)
        if j is not None and old_block not in self._used:
            self._used.add(old_block)
            self.in_place_bytes += self.block_bytes
            return j
        return None

    def write_copy(self, model, old_block: int, new_block: int) -> None:
        """The copy of `old_block`'s kept layers into `new_block` of the new view (after the
        re-split: `model._kv` is the new range's)."""
        row = self._data[self._copies[old_block]]  # [kept layers, 2, bs, H, D]
        first = self.stay.start - model.drop_state.keep.start
        for i, (k, v) in enumerate(model._kv[first:first + len(self.stay)]):
            k[new_block] = row[i, 0]
            v[new_block] = row[i, 1]
        self.copied_bytes += self.block_bytes

    def done(self) -> None:
        """Every use placed: the copies are let go."""
        self._data = None


def place_own(stage, src: Sequence[int], dst: Sequence[int]) -> list | None:
    """The head's kept KV of stage blocks `src` copied, inside the arena, to where solo blocks
    `dst`'s layers lie, in an order that overwrites nothing still to be read (a cycle goes round
    one free stage block): then nothing is held outside the arena. Returns the copies made;
    None when none is free for a cycle (the caller gathers them instead)."""
    view, layers = stage.model.drop_state.view, stage.model.config.num_layers
    pairs = {(s, view.local_at(d * layers)) for s, d in zip(src, dst)}
    if any(h is None for _, h in pairs):
        return None
    order = copy_order(pairs, stage.map.spare)
    for s, d in order or ():
        stage._copy_block(s, d)
    return order


def own_moves(stage, tables: Mapping[int, Sequence[int]]) -> tuple[list[int], list[int], int]:
    """The head's kept layers at the restore: (stage blocks to copy from, solo blocks to copy
    into, blocks already in place). A block is in place when its stage block's layers lie where
    its solo block's do (`base` = solo block x layers)."""
    view, layers = stage.model.drop_state.view, stage.model.config.num_layers
    src, dst, in_place = [], [], 0
    for rid, s in stage.seqs.items():
        new = tables[rid]
        for local, block in zip(stage.map.locals(s.table[:len(new)]), new):
            if view.base(local) == block * layers:
                in_place += 1
            else:
                src.append(local)
                dst.append(block)
    return src, dst, in_place
