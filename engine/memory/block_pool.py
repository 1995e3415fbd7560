"""Device KV blocks handed out one at a time, vLLM-style: any free block will do.

Pure mechanism: it answers `can_allocate` and does `allocate`/`free`; the scheduler decides.
"""

from __future__ import annotations

from collections.abc import Sequence


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
        # the prefix cache's blocks (engine/memory/prefix_cache.py decides, this maps): a cached
        # block is never on the free stack; `_users` counts the tables holding it, and one no
        # table holds (idle) is free memory only once the scheduler evicts its key
        self._cached: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._users: dict[int, int] = {}
        self._idle = 0

    @property
    def num_total(self) -> int:
        return len(self._all)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        """Blocks some request's table holds."""
        return len(self._all) - len(self._free) - self._idle

    @property
    def num_cached(self) -> int:
        """Blocks the prefix cache knows by key (held or idle)."""
        return len(self._cached)

    @property
    def num_idle(self) -> int:
        """Cached blocks no table holds."""
        return self._idle

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
        for b in reversed(table):
            if b in self._key_of:
                self._users[b] -= 1
                self._idle += self._users[b] == 0
            else:
                self._free.append(b)
        return len(table)

    def publish(self, request_id: int, index: int, key: bytes) -> None:
        """Block `index` of the request's table is cached under `key` from now on."""
        table = self._tables.get(request_id, [])
        if index >= len(table):
            raise BlockPoolError(f"request {request_id} publishes block {index} of {len(table)}")
        b = table[index]
        if key in self._cached or b in self._key_of:
            raise BlockPoolError(f"request {request_id}: block {b} or its key is cached already")
        self._cached[key], self._key_of[b], self._users[b] = b, key, 1

    def attach(self, request_id: int, keys: Sequence[bytes]) -> list[int]:
        """Start the table of a request holding no blocks with the cached blocks of `keys`."""
        if self._tables.get(request_id):
            raise BlockPoolError(f"request {request_id} takes cached blocks while holding blocks")
        blocks = [self._cached[k] for k in keys]
        for b in blocks:
            self._idle -= self._users[b] == 0
            self._users[b] += 1
        self._tables[request_id] = list(blocks)
        return blocks

    def evict(self, key: bytes) -> int:
        """The block cached under `key`, which no table holds, goes back to the free stack."""
        b = self._cached[key]
        if self._users[b]:
            raise BlockPoolError(f"evicting block {b}, which {self._users[b]} requests hold")
        del self._cached[key], self._key_of[b], self._users[b]
        self._idle -= 1
        self._free.append(b)
        return b

    def owners(self) -> dict[int, list[int]]:
        """Every request's table (for invariant checks and inspection)."""
        return {rid: list(t) for rid, t in self._tables.items()}

    def resize(self, n: int) -> list[tuple[int, int]]:
        """KunServe (§4.1, §4.4): the pool becomes blocks `[first, first + n)`. Growing adds the
        new range to the free stack (below the free blocks, so the old ones are reused first);
        shrinking moves each held block of the removed range to a free block kept (the caller
        copies the KV), and returns those (src, dst) moves. Raises when the kept range cannot
        hold every held block, or the prefix cache holds a block of the removed range."""
        first, old = self._all.start, len(self._all)
        if n < 1:
            raise BlockPoolError(f"a block pool needs at least one block, asked for {n}")
        if n >= old:
            self._free[:0] = list(reversed(range(first + old, first + n)))
            self._all = range(first, first + n)
            return []
        end = first + n
        if any(b >= end for b in self._key_of):
            raise BlockPoolError("the prefix cache holds blocks of the range a shrink removes")
        kept_free = [b for b in self._free if b < end]
        held = [(rid, i, b) for rid, t in self._tables.items() for i, b in enumerate(t) if b >= end]
        if len(held) > len(kept_free):
            raise BlockPoolError(f"shrinking to {n} blocks: {len(held)} held blocks must move "
                                 f"and only {len(kept_free)} kept blocks are free")
        moves = []
        for rid, i, b in held:
            dst = kept_free.pop()
            self._tables[rid][i] = dst
            moves.append((b, dst))
        self._free = kept_free
        self._all = range(first, end)
        return moves
