"""Prompt token ids that cost O(1) memory: a replayed hour of the Mooncake trace holds ~150M
prompt tokens, which the simulator never reads. `TokenIds` is a lazy `Sequence[int]`: a
concatenation of parts, each a seeded pseudo-random run or a concrete sequence (a parent
conversation's real output). Reading it (`ids[i]`, slices, iteration) computes the ids, so the
torch backend gets real, reproducible tokens."""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import overload

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class _Lazy(Sequence[int]):
    """A sequence whose id i is `_at(i)`, computed when read."""

    def __len__(self) -> int:
        raise NotImplementedError

    def _at(self, i: int) -> int:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        n = len(self)
        if isinstance(i, slice):
            return [self._at(k) for k in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self._at(i)


class RandomRun(_Lazy):
    """`length` ids in [low, vocab), id i a hash of (seed, i)."""

    def __init__(self, seed: int, length: int, vocab: int, low: int = 0) -> None:
        if not 0 <= low < vocab:
            raise ValueError(f"token range [{low}, {vocab}) is empty")
        self.seed, self.length, self.vocab, self.low = _mix(seed), length, vocab, low

    def __len__(self) -> int:
        return self.length

    def _at(self, i: int) -> int:
        return self.low + _mix(self.seed ^ i) % (self.vocab - self.low)


class TokenIds(_Lazy):
    """The concatenation of `parts`, read lazily."""

    def __init__(self, parts: Sequence[Sequence[int]] = ()) -> None:
        self._parts: list[Sequence[int]] = []
        self._ends: list[int] = []
        n = 0
        for p in parts:
            if isinstance(p, TokenIds):  # flatten, so lookups stay one bisect deep
                for q, end in zip(p._parts, p._ends):
                    self._parts.append(q)
                    n += len(q)
                    self._ends.append(n)
            elif len(p):
                self._parts.append(p)
                n += len(p)
                self._ends.append(n)
        self._len = n

    @classmethod
    def random(cls, seed: int, length: int, vocab: int, low: int = 0) -> TokenIds:
        return cls([RandomRun(seed, length, vocab, low)])

    def __len__(self) -> int:
        return self._len

    def _at(self, i: int) -> int:
        k = bisect.bisect_right(self._ends, i)
        start = self._ends[k - 1] if k else 0
        return self._parts[k][i - start]

    def __iter__(self) -> Iterator[int]:
        for p in self._parts:
            yield from (p[k] for k in range(len(p)))

    def head(self, n: int) -> TokenIds:
        """The first n ids, still lazy."""
        out = TokenIds()
        for p, end in zip(self._parts, self._ends):
            if out._len >= n:
                break
            take = min(len(p), n - out._len)
            part = p if take == len(p) else _Head(p, take)
            out._parts.append(part)
            out._len += take
            out._ends.append(out._len)
        return out

    def __repr__(self) -> str:
        return f"TokenIds(len={self._len}, parts={len(self._parts)})"


class _Head(Sequence[int]):
    def __init__(self, seq: Sequence[int], n: int) -> None:
        self._seq, self._n = seq, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._seq[k] for k in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._seq[i]


def extend_context(context: Sequence[int], shared: int, total: int, seed: int, vocab: int,
                   low: int = 0) -> TokenIds:
    """A prompt of `total` ids: the first `shared` ids of `context` (an earlier turn's prompt and
    output), then fresh seeded ids."""
    shared = min(shared, len(context), total)
    head = context.head(shared) if isinstance(context, TokenIds) else TokenIds([_Head(context, shared)])
    return TokenIds([head, RandomRun(seed, total - shared, vocab, low)])
