"""Automatic prefix caching (vLLM's APC, SGLang's radix cache): full device KV blocks known by
their content, kept after their request lets go of them and taken again by any later request
whose context starts the same way.

A block's key is a chain hash: BLAKE2b of its parent's key and its own tokens, so two blocks
with the same key hold the KV of the same tokens after the same prefix (the KV of a token
depends on everything before it; a key that forgot the parent would hand out a block computed
after another prefix). Only full blocks get a key: a partly filled block is still being
written.

Pure bookkeeping over keys, no block ids (the allocator maps keys to blocks) and no I/O:
- every cached key has a count of the live requests holding it;
- a key nobody holds is *idle*: its block is free memory that can be reclaimed at once, and
  idle keys are evicted least recently released first (a request lets go of its blocks last
  block first, so a prefix's tail goes before its head, which more requests share);
- a request holds the keys it found at admission (a prefix hit) and the keys of blocks it
  computed itself and published; a block it computed whose key was already cached (another
  request got there first) stays its private block and is never shared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

Key = bytes
"""A block's chain hash (16 bytes)."""

_ROOT: Key = b""


def block_key(parent: Key, tokens: Sequence[int]) -> Key:
    """The key of a full block holding `tokens` right after the block whose key is `parent`."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCacheError(Exception):
    """The cache's caller broke an invariant (a bug, not a user error)."""


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise PrefixCacheError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._refs: dict[Key, int] = {}
        """Every cached key -> live requests holding it."""
        self._idle: OrderedDict[Key, None] = OrderedDict()
        """Keys no request holds, least recently released first."""
        self._held: dict[int, list[Key]] = {}
        """request id -> keys it holds, in block order."""
        self._chains: dict[int, list[Key]] = {}
        """request id -> keys of its context's full blocks worked out so far (a memo)."""
        self._next: dict[int, int] = {}
        """request id -> index of its first block not yet considered for publishing."""
        self.shared_extra = 0
        """Sum over keys of (holders - 1): how much adding up each request's blocks overcounts
        the device blocks in use."""

    # ---------------------------------------------------------------------------- reading

    @property
    def num_cached(self) -> int:
        return len(self._refs)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def holders(self, key: Key) -> int:
        """Live requests holding `key` (0 for an idle key); KeyError if it is not cached."""
        return self._refs[key]

    def held(self, request_id: int) -> tuple[Key, ...]:
        return tuple(self._held.get(request_id, ()))

    def known(self) -> list[int]:
        """Requests holding keys or with a memo of their keys."""
        return list(self._held.keys() | self._chains.keys())

    def idle_order(self) -> list[Key]:
        """Idle keys, next to be evicted first."""
        return list(self._idle)

    def keys(self, request_id: int, tokens: Sequence[int], blocks: int) -> list[Key]:
        """The keys of the first `blocks` full blocks of `tokens` (the request's context), worked
        out once per request: a context only ever grows at its end."""
        chain = self._chains.setdefault(request_id, [])
        bs = self.block_size
        while len(chain) < blocks:
            i = len(chain)
            chain.append(block_key(chain[-1] if chain else _ROOT, tokens[i * bs:(i + 1) * bs]))
        return chain[:blocks]

    def lookup(self, request_id: int, tokens: Sequence[int]) -> list[Key]:
        """The cached keys a request with context `tokens` can start from: its longest run of
        leading full blocks that are cached, leaving at least its last token to compute (the
        step that computes it samples the next token)."""
        limit = (len(tokens) - 1) // self.block_size
        chain = self._chains.get(request_id)
        if chain is None or len(chain) < limit:
            self.keys(request_id, tokens, limit)
            chain = self._chains[request_id]
        refs, hits = self._refs, []
        for i in range(limit):
            if chain[i] not in refs:
                break
            hits.append(chain[i])
        return hits

    def idle_count(self, keys: Iterable[Key], held_into: set[Key] | None = None) -> int:
        """Of `keys`, those no request holds (taking them uses up free memory); the others are
        added to `held_into` when given."""
        idle, refs = 0, self._refs
        for k in keys:
            if refs.get(k) == 0:
                idle += 1
            elif held_into is not None:
                held_into.add(k)
        return idle

    def shared_blocks(self, request_id: int,
                      wanted: set[Key] | frozenset[Key] = frozenset()) -> int:
        """Blocks the request holds that stay in use if it lets go of them: held by another
        request too, or in `wanted` (keys another request is about to take)."""
        refs = self._refs
        if not wanted:
            return sum(1 for k in self._held.get(request_id, ()) if refs[k] > 1)
        return sum(1 for k in self._held.get(request_id, ()) if refs[k] > 1 or k in wanted)

    # ---------------------------------------------------------------------------- changing

    def acquire(self, request_id: int, keys: Sequence[Key]) -> None:
        """A request admitted with a prefix hit takes `keys` (its first blocks, in order)."""
        if self._held.get(request_id):
            raise PrefixCacheError(f"request {request_id} takes a prefix while holding blocks")
        for k in keys:
            refs = self._refs.get(k)
            if refs is None:
                raise PrefixCacheError(f"request {request_id} takes a key that is not cached")
            if refs == 0:
                del self._idle[k]
            else:
                self.shared_extra += 1
            self._refs[k] = refs + 1
        self._held[request_id] = list(keys)
        self._next[request_id] = len(keys)

    def skip(self, request_id: int, blocks: int) -> None:
        """The request's first `blocks` blocks were filled by a copy, not a step (a swap-in):
        they stay private (an asynchronous copy may still be writing them)."""
        self._next[request_id] = max(self._next.get(request_id, 0), blocks)

    def publishable(self, request_id: int, computed: int) -> bool:
        """The request filled a block since it last published."""
        return computed // self.block_size > self._next.get(request_id, 0)

    def publish(self, request_id: int, tokens: Sequence[int],
                computed: int) -> list[tuple[int, Key]]:
        """The request's KV now covers `computed` tokens of `tokens`: each block it filled since
        the last call is cached under its key unless that key already is. Returns the
        (block index, key) pairs newly cached, for the allocator."""
        full = computed // self.block_size
        start = self._next.get(request_id, 0)
        if full <= start:
            return []
        chain = self.keys(request_id, tokens, full)
        held = self._held.setdefault(request_id, [])
        out = []
        for i in range(start, full):
            k = chain[i]
            if k not in self._refs:
                self._refs[k] = 1
                held.append(k)
                out.append((i, k))
        self._next[request_id] = full
        return out

    def release(self, request_id: int) -> None:
        """The request lets go of its device blocks (preempted, or ended); its keys that no one
        else holds become idle, its last block first in line for eviction."""
        for k in reversed(self._held.pop(request_id, ())):
            refs = self._refs[k] - 1
            self._refs[k] = refs
            if refs == 0:
                self._idle[k] = None
            else:
                self.shared_extra -= 1
        self._next.pop(request_id, None)

    def forget(self, request_id: int) -> None:
        """The request ended: release it and drop its memo."""
        self.release(request_id)
        self._chains.pop(request_id, None)

    def evict(self, n: int) -> list[Key]:
        """Drop the `n` least recently released idle keys (their blocks become free)."""
        if n > len(self._idle):
            raise PrefixCacheError(f"asked to evict {n} blocks, only {len(self._idle)} are idle")
        out = []
        for _ in range(n):
            k, _ = self._idle.popitem(last=False)
            del self._refs[k]
            out.append(k)
        return out
