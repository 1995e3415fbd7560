"""Device KV blocks handed out one at a time, vLLM-style: any free block will do.

Pure mechanism: it answers `can_allocate` and does `allocate`/`free`; the scheduler decides.
"""

from __future__ import annotations


class BlockPoolError(Exception):
    """An invariant of the pool was broken by its caller (a bug, not a user error)."""


class BlockPool:
    """Free block ids in a stack (the most recently freed is reused first, which keeps a busy
    engine's working set small); each request's block table in allocation order."""

    def __init__(self, block_ids: range) -> None:
        if len(block_ids) == 0:
            raise BlockPoolError("a block pool needs at least one block")
        self._all = block_ids
        self._free: list[int] = list(reversed(block_ids))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_total(self) -> int:
        return len(self._all)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._all) - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def expect(self, request_id: int, blocks: int) -> None:
        """A size hint block groups use (`DeviceBlocks`); any free block will do here."""

    def table(self, request_id: int) -> list[int]:
        """The request's blocks, in token order (empty if it holds none)."""
        return self._tables.get(request_id, [])

    def allocate(self, request_id: int, n: int) -> list[int]:
        """Append n blocks to the request's table and return them."""
        if n > len(self._free):
            raise BlockPoolError(f"request {request_id} asked for {n} blocks, {len(self._free)} free")
        taken = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        taken.reverse()
        self._tables.setdefault(request_id, []).extend(taken)
        return taken

    def free(self, request_id: int) -> int:
        """Return all of the request's blocks to the pool; returns how many."""
        table = self._tables.pop(request_id, [])
        self._free.extend(reversed(table))
        return len(table)

    def owners(self) -> dict[int, list[int]]:
        """Every request's table (for invariant checks and inspection)."""
        return {rid: list(t) for rid, t in self._tables.items()}
