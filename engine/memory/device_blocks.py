"""The one interface the allocator actor asks of a device block allocator.

Two allocators implement it: `BlockPool` (vLLM's per-block free stack) and `BlockGroupManager`
(FastSwitch §3.1's block groups). The actor holds either through this protocol and never asks
which one it has.
"""

from __future__ import annotations

from typing import Protocol


class DeviceBlocks(Protocol):
    @property
    def num_total(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def num_allocated(self) -> int: ...

    def can_allocate(self, n: int) -> bool: ...

    def expect(self, request_id: int, blocks: int) -> None:
        """Hint: the request will probably need about `blocks` blocks in all (block groups size
        its first group to fit; the per-block pool ignores it)."""

    def table(self, request_id: int) -> list[int]:
        """The request's blocks, in token order (empty if it holds none)."""

    def allocate(self, request_id: int, n: int) -> list[int]:
        """Append n blocks to the request's table and return them."""

    def free(self, request_id: int) -> int:
        """Return all of the request's blocks; returns how many."""

    def owners(self) -> dict[int, list[int]]:
        """Every request's table (for invariant checks and inspection)."""
