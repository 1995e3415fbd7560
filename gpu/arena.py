"""One flat buffer per device holding both the weights and the KV blocks.

The buffer is cut into equal blocks; a block holds one KV block for every layer:
    block_elems = num_layers * 2 * block_size * num_kv_heads * head_dim
Weights come first: the global tensors (embedding, final norm, untied LM head), then each decoder
layer from its own block boundary, so a layer's weights fill a whole range of blocks that can later
be handed to the KV pool (KunServe drops a layer's weights under memory pressure and reuses their
range as KV blocks). The KV view is block-major, so a run of consecutive block ids is one
contiguous byte range: what block-group allocation and one-copy swaps rely on.
"""

from __future__ import annotations

import math

import attrs
import torch

from gpu.config import ModelConfig
from gpu.loader import global_tensor_shapes, layer_tensor_shapes

_ALIGN_BYTES = 256
"""Each weight starts at a multiple of this many bytes within its range."""


def block_elems(config: ModelConfig, block_size: int) -> int:
    """Elements of one block: block_size tokens of K and V for every layer."""
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim


def block_nbytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return block_elems(config, block_size) * dtype.itemsize


def blocks_for_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype,
                     nbytes: int) -> int:
    """How many KV blocks fit in `nbytes` of device memory (weights not included)."""
    return max(0, nbytes // block_nbytes(config, block_size, dtype))


@attrs.frozen(kw_only=True)
class WeightSlot:
    """Where one weight tensor lives in the flat buffer."""

    start: int
    """First element."""
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@attrs.frozen(kw_only=True)
class ArenaLayout:
    """The weight placement for one model and block size; no memory is touched."""

    block_elems: int
    slots: dict[str, WeightSlot]
    """Every weight tensor by its Hugging Face name."""
    global_blocks: range
    """Blocks holding the tensors outside the decoder layers."""
    layer_blocks: tuple[range, ...]
    """layer_blocks[l]: the blocks holding exactly decoder layer l's tensors."""

    @property
    def weight_blocks(self) -> int:
        return self.layer_blocks[-1].stop if self.layer_blocks else self.global_blocks.stop


def plan_layout(config: ModelConfig, block_size: int, dtype: torch.dtype) -> ArenaLayout:
    """Place the global tensors, then each layer from a fresh block boundary."""
    per_block = block_elems(config, block_size)
    align = max(1, _ALIGN_BYTES // dtype.itemsize)
    slots: dict[str, WeightSlot] = {}

    def place(shapes: dict[str, tuple[int, ...]], first_block: int) -> range:
        offset = first_block * per_block
        for name, shape in shapes.items():
            slots[name] = WeightSlot(start=offset, shape=shape)
            offset += -(-math.prod(shape) // align) * align
        return range(first_block, max(first_block + 1, -(-offset // per_block)))

    global_blocks = place(global_tensor_shapes(config), 0)
    layers: list[range] = []
    for layer in range(config.num_layers):
        first = layers[-1].stop if layers else global_blocks.stop
        layers.append(place(layer_tensor_shapes(config, layer), first))
    return ArenaLayout(block_elems=per_block, slots=slots, global_blocks=global_blocks,
                       layer_blocks=tuple(layers))


class DeviceArena:
    """The preallocated buffer of one device: weights at the start, then the KV blocks.

    `kv` views the WHOLE buffer as blocks, weight blocks included, so block ids are the same
    whether a block holds weights now or KV later; `kv_block_ids` are the ones free for KV.
    """

    def __init__(self, config: ModelConfig, *, num_kv_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        if num_kv_blocks < 1 or block_size < 1:
            raise ValueError(f"DeviceArena needs num_kv_blocks >= 1 and block_size >= 1, got "
                             f"num_kv_blocks={num_kv_blocks}, block_size={block_size}")
        self.config = config
        self.block_size = block_size
        self.layout = plan_layout(config, block_size, dtype)
        self.num_kv_blocks = num_kv_blocks
        self.total_blocks = self.layout.weight_blocks + num_kv_blocks
        # zeroed, not empty: stale NaN bit patterns in never-written KV slots would leak
        # through masked attention (0 * NaN)
        self.buffer = torch.zeros(self.total_blocks * self.layout.block_elems, dtype=dtype,
                                  device=device)  # [total_blocks * block_elems]
        # [total_blocks, num_layers, 2, block_size, Hkv, D]
        self.kv = self.buffer.view(self.total_blocks, config.num_layers, 2, block_size,
                                   config.num_kv_heads, config.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def block_nbytes(self) -> int:
        return self.layout.block_elems * self.buffer.element_size()

    @property
    def weight_blocks(self) -> int:
        return self.layout.weight_blocks

    @property
    def kv_block_ids(self) -> range:
        """Block ids free for KV: every block after the weights."""
        return range(self.layout.weight_blocks, self.total_blocks)

    def layer_block_range(self, layer: int) -> range:
        """The blocks holding exactly decoder layer `layer`'s weights."""
        return self.layout.layer_blocks[layer]

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each [total_blocks, block_size, Hkv, D] (strided)."""
        return self.kv[:, layer, 0], self.kv[:, layer, 1]

    def weight(self, name: str) -> torch.Tensor:
        """A view of one weight tensor inside the buffer, by its Hugging Face name."""
        slot = self.layout.slots.get(name)
        if slot is None:
            raise KeyError(f"arena has no weight {name!r}")
        return self.buffer[slot.start:slot.start + slot.numel].view(slot.shape)

    def weight_names(self) -> list[str]:
        return list(self.layout.slots)
