"""A model's weights in arena blocks as the torch backend lays them out, without torch: what an
instance's KV pool leaves them (sim/profile.py `Profile.num_blocks`), what the simulator's
KunServe groups free when members drop layers and what they move when they restore them.

gpu/arena.py `plan_layout` places the global tensors (embeddings, final norm, untied LM head)
from block 0, then each decoder layer from a fresh block boundary, every tensor starting on a
256-byte multiple. A member that drops layers frees only those layers' blocks: every member keeps
the global tensors (gpu/stage_view.py `kept_weight_ranges`). The simulator's group pool
(shunter/cluster/groups.py) and its restore's weight bytes (shunter/cluster/sim_restore.py) read
these counts, and so does the monitor's planner (`planned_pool`: the groups as they will be);
tests/sim/test_kunserve_group_pool.py holds them equal to `plan_layout` and the
torch group's pool (`group_pool_blocks`, for every split: `stage_capacity`), and
tests/sim/test_kunserve_instance_pool.py `weight_blocks` to `plan_layout`'s. The model shape
(sim/profile.py `ModelShape`) names no biases: a Qwen2 layer's q/k/v biases are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from engine.cluster.drop_plan import group_pool
from engine.cluster.plan import stage_layers

ALIGN_BYTES = 256
"""gpu/arena.py `_ALIGN_BYTES`: each weight starts at a multiple of this many bytes."""


def _blocks(sizes: list[int], model, block_size: int) -> int:
    align = max(1, ALIGN_BYTES // model.dtype_bytes)
    elems = sum(-(-n // align) * align for n in sizes)
    per_block = model.block_bytes(block_size) // model.dtype_bytes
    return max(1, -(-elems // per_block))


def global_blocks(model, block_size: int) -> int:
    """Blocks the global tensors take (no member drops them)."""
    v, h = model.vocab_size, model.hidden_size
    return _blocks([v * h, h] + ([] if model.tie_word_embeddings else [v * h]), model, block_size)


def layer_blocks(model, block_size: int) -> int:
    """Blocks one decoder layer's weights take, from its own block boundary."""
    h, i = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return _blocks([h, q * h, kv * h, kv * h, h * q, h, i * h, i * h, h * i], model, block_size)


def freed_blocks(model, block_size: int) -> int:
    """KV blocks a group gains for each member past the first: one copy of the decoder layers
    (a group of two halves frees half the layers on each member). The global tensors stay on
    every member, so they are not counted."""
    return model.num_layers * layer_blocks(model, block_size)


def weight_blocks(model, block_size: int) -> int:
    """Blocks the whole weights take in the arena: the global tensors, then every layer from its
    own block boundary (gpu/arena.py `ArenaLayout.weight_blocks`). Llama-3-8B at 16 tokens a
    block: 1,003 + 32 x 209 = 7,691, where the unaligned bytes fill 7,658.x."""
    return global_blocks(model, block_size) + model.num_layers * layer_blocks(model, block_size)


def stride_layers(num_layers: int, kept: int) -> int:
    """gpu/stage_view.py `stride_layers`: the smallest divisor of the layer count at least the
    layers a member keeps (its stage blocks are that many layers apart)."""
    return next(d for d in range(kept, num_layers + 1) if num_layers % d == 0)


def stage_capacity(model, block_size: int, total_blocks: int, keep: range) -> int:
    """Stage blocks free for KV in an arena of `total_blocks` blocks re-viewed for a member
    keeping layers `keep` (gpu/stage_view.py `StageView.capacity`): blocks `stride` layers
    apart, each holding the kept layers' K and V, less those over weights still kept (the
    global tensors and the kept layers' blocks)."""
    L = model.num_layers
    stride, span = stride_layers(L, len(keep)), len(keep)
    first = keep.start % stride  # in units of one layer's K and V of a block
    n = (total_blocks * L - first - span) // stride + 1
    starts = first + np.arange(n, dtype=np.int64) * stride
    g, per = global_blocks(model, block_size), layer_blocks(model, block_size)
    usable = np.ones(n, dtype=bool)
    for lo, hi in ((0, g), (g + keep.start * per, g + keep.stop * per)):
        usable &= ~((starts < hi * L) & (starts + span > lo * L))
    return int(np.count_nonzero(usable))


def group_pool_blocks(model, block_size: int, total_blocks: int,
                      layers: tuple[range, ...]) -> int:
    """A group's KV blocks when every member has an arena of `total_blocks` blocks: its
    smallest member's stage capacity (gpu/stage_view.py `group_pool_blocks`). Uneven splits
    waste what their stride leaves over (Llama-3-8B in 3: 11 layers kept 16 apart)."""
    return min(stage_capacity(model, block_size, total_blocks, keep) for keep in layers)


def sized_pool(model, block_size: int, pools: Sequence[int], layers: tuple[range, ...]) -> int:
    """The KV blocks of a group whose members alone had `pools` and keep `layers`: torch's
    (`group_pool_blocks`, in an arena of the weights and the member's own pool); members with
    pools of different sizes (no torch group has them): their pools and the dropped layers'
    blocks (engine/cluster/drop_plan.py `group_pool`'s count)."""
    if len(set(pools)) > 1:
        return group_pool(pools, freed_blocks(model, block_size))
    return group_pool_blocks(model, block_size, weight_blocks(model, block_size) + pools[0],
                             layers)


def planned_pool(model, block_size: int):
    """The group pool the monitor's planner sizes groups with (engine/cluster/overload.py
    `OverloadMonitor(pool=...)`): `sized_pool` of members in pipeline order, the layers split
    as every plan splits them (engine/cluster/plan.py `stage_layers`)."""

    @lru_cache(maxsize=256)
    def pool(pools: tuple[int, ...]) -> int:
        return sized_pool(model, block_size, pools, stage_layers(model.num_layers, len(pools)))

    return lambda pools: pool(tuple(pools))
