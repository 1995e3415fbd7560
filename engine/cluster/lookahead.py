"""KunServe's lookahead microbatch formation (§4.3): an attention-aware cost model of a chunk
and a microbatch (Eq. 1-3), fitted by least squares per pipeline stage, and the recursive split
of a step's work into cost-balanced microbatches.

Eq. 1, the cost of a chunk of `n` new tokens after `p` tokens already in the KV cache:
    prefix-attn alpha * p * n  +  self-attn beta * n^2  +  FFN gamma * n
Eq. 2-3, a microbatch: the sum of its chunks' costs plus `delta` once (the weights are loaded
once per batch: the term the paper subtracts for the requests sharing them).
Optionally (`decode_term`) a decode (a chunk of one token) pays `alpha_decode * p` for its
context instead of `alpha * p`: a decode reads its whole context's KV for one token (memory
bound) while a prefill chunk's prefix attention reuses each cached token for all its n tokens,
so one coefficient cannot price both (measured on the simulator's A10 profile, whose decode
context costs 21x a prefill's prefix token: Eq. 1's error on decode microbatches 27% with
LongBench-like lengths, 1.7% with the term; bench/results/kunserve_sim_longctx*).

The split (Figure 10-11): start from one microbatch holding every chunk; cut it in two whose
costs stand in the ratio of the microbatches each side must still become, cutting a prefill
chunk in two where the balance falls inside it (the later piece then pays prefix attention for
the earlier one); recurse until there are `parts` microbatches, or a piece would fall under
`min_tokens`. Plain functions; the caller passes the cost model of its stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

Chunk = tuple[int, int, int]
"""(key, start, tokens): `key` names the sequence (its index in the step)."""


@attrs.frozen(kw_only=True)
class ChunkCost:
    alpha: float
    """ms per (prefix token x new token): attention to the KV already cached."""
    beta: float
    """ms per new token squared: attention among the chunk's own tokens."""
    gamma: float
    """ms per new token: projections and FFN."""
    delta: float
    """ms per microbatch: what its chunks share (the weights read once)."""
    alpha_decode: float | None = None
    """ms per context token of a decode (None: Eq. 1 as published, `alpha`)."""

    def chunk_ms(self, start: int, n: int) -> float:
        if n == 1 and self.alpha_decode is not None:
            return self.alpha_decode * start + self.beta + self.gamma
        return self.alpha * start * n + self.beta * n * n + self.gamma * n

    def batch_ms(self, chunks: Sequence[tuple[int, int]]) -> float:
        if not chunks:
            return 0.0
        return self.delta + sum(self.chunk_ms(s, n) for s, n in chunks)


def features(chunks: Sequence[tuple[int, int]], *, decode_term: bool = False) -> list[float]:
    """The regressors of Eq. 1-3 for one microbatch: (sum p*n, sum n^2, sum n, 1); with
    `decode_term`, (sum p*n over prefill chunks, sum p over decodes, sum n^2, sum n, 1)."""
    sq, n_all = float(sum(n * n for _, n in chunks)), float(sum(n for _, n in chunks))
    if decode_term:
        return [float(sum(s * n for s, n in chunks if n > 1)),
                float(sum(s for s, n in chunks if n == 1)), sq, n_all, 1.0]
    return [float(sum(s * n for s, n in chunks)), sq, n_all, 1.0]


def fit_chunk_cost(samples: Sequence[tuple[Sequence[tuple[int, int]], float]], *,
                   decode_term: bool = False) -> ChunkCost:
    """Least squares over measured microbatches: (chunks as (start, tokens), milliseconds)."""
    k = 5 if decode_term else 4
    if len(samples) < k:
        raise ValueError(f"fitting Eq. 1-3 needs at least {k} samples, got {len(samples)}")
    x = np.array([features(c, decode_term=decode_term) for c, _ in samples])
    y = np.array([ms for _, ms in samples])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    if decode_term:
        return ChunkCost(alpha=float(coef[0]), alpha_decode=float(coef[1]),
                         beta=float(coef[2]), gamma=float(coef[3]), delta=float(coef[4]))
    return ChunkCost(alpha=float(coef[0]), beta=float(coef[1]), gamma=float(coef[2]),
                     delta=float(coef[3]))


TOKEN_COUNT = ChunkCost(alpha=0.0, beta=0.0, gamma=1.0, delta=0.0)
"""A chunk costs its tokens: what `microbatch tokens` balances, and what lookahead balances
before it has a fit."""


@attrs.frozen
class TokenLine:
    """The token-count model the paper compares Eq. 1-3 with (Figure 15):
    ms = intercept + per_token x tokens."""

    intercept: float
    per_token: float

    def batch_ms(self, chunks: Sequence[tuple[int, int]]) -> float:
        return self.intercept + self.per_token * sum(n for _, n in chunks)


def fit_token_line(samples: Sequence[tuple[Sequence[tuple[int, int]], float]]) -> TokenLine:
    """Least squares over measured microbatches, as `fit_chunk_cost` (a flat line when every
    microbatch has the same tokens)."""
    xs = [float(sum(n for _, n in c)) for c, _ in samples]
    ys = [ms for _, ms in samples]
    k = len(xs)
    sx, sy = sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    den = k * sxx - sx * sx
    slope = (k * sxy - sx * sy) / den if den else 0.0
    return TokenLine(intercept=(sy - slope * sx) / k, per_token=slope)


def lookahead_split(chunks: Sequence[Chunk], parts: int, cost: ChunkCost, *,
                    min_tokens: int = 1, fill: bool = False) -> list[list[Chunk]]:
    """Cut `chunks` into at most `parts` microbatches of balanced predicted cost, in order,
    never leaving a piece of a prefill chunk under `min_tokens` tokens. Every token of every
    chunk lands in exactly one microbatch, in order; no microbatch is empty.

    A chunk that cannot be cut (a decode, or a prefill chunk under 2 x `min_tokens`) where the
    balance falls goes to the side that leaves the costs closer to balance (§4.3: two
    cost-balanced microbatches). `fill=True` instead always starts the next microbatch with it,
    as a token budget fills a microbatch and the chunk that does not fit waits for the next
    (the token-count formation lookahead is compared with, §4.3 Figure 9)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    work = [c for c in chunks if c[2] > 0]
    if not work:
        return []
    return [mb for mb in _split(work, parts, cost, min_tokens, fill) if mb]


def _split(chunks: list[Chunk], parts: int, cost: ChunkCost, min_tokens: int,
           fill: bool) -> list[list[Chunk]]:
    if parts == 1 or (len(chunks) == 1 and chunks[0][2] < 2 * min_tokens):
        return [chunks]
    lp = parts // 2
    rp = parts - lp
    costs = [cost.chunk_ms(s, n) for _, s, n in chunks]
    after = sum(costs)  # cost of the chunks not yet on the left
    acc = 0.0
    for i, (key, s, n) in enumerate(chunks):
        after -= costs[i]
        if (acc + costs[i]) * rp <= after * lp or (i == 0 and n == 1):
            acc += costs[i]
            continue
        # the balance falls inside this chunk: cut it where left and right costs (the right
        # piece paying prefix attention for the left one) stand as lp : rp
        def fits(k: int, s: int = s, n: int = n, acc: float = acc, after: float = after) -> bool:
            return (acc + cost.chunk_ms(s, k)) * rp <= (after + cost.chunk_ms(s + k, n - k)) * lp

        k = _cut(s, n, fits, min_tokens)
        if k > 0:
            left, right = chunks[:i] + [(key, s, k)], [(key, s + k, n - k)] + chunks[i + 1:]
        elif i == 0 or (not fill and i + 1 < len(chunks)
                        and max((acc + costs[i]) / lp, after / rp)
                        < max(acc / lp, (after + costs[i]) / rp)):
            left, right = chunks[:i + 1], chunks[i + 1:]
        else:
            left, right = chunks[:i], chunks[i:]
        break
    else:
        return [chunks]
    if not left or not right:
        return [chunks]
    return (_split(left, lp, cost, min_tokens, fill)
            + _split(right, rp, cost, min_tokens, fill))


def _cut(start: int, n: int, fits, min_tokens: int) -> int:
    """The most tokens k of a chunk for which `fits(k)` holds (it holds for small k and not for
    large ones), leaving at least `min_tokens` on each side; 0: do not cut."""
    lo, hi = min_tokens, n - min_tokens
    if hi < lo or not fits(lo):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
