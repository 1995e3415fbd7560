"""Iteration latency as a function of the batch's shape (BROS §4.1; vidur-style composition).

    t_ms = a + [b*P + c*sum(p_i^2) + f*sum(p_i*prefix_i)] + [d*D + e*sum(ctx_j)]

P: prefill tokens; p_i: chunk length of prefill i and prefix_i the tokens cached before it;
D: decoding sequences; ctx_j: context length of decode j (plus g when the step computes more
than one token row: see `CostModel.g_ms_multi_row`). The first bracket is the prefill
model, the second the decode model: BROS fits them apart (`fit_split`: decode-only batches give
a, d, e; prefill-only batches the rest) and sums them per batch. Beside it, `CopyCost` models a
swap (calls x dispatch + bytes / bandwidth); with asynchronous copies the iteration takes
max(model, swap) (§4.1). The simulator waits this long for a step; policies use it to predict
whether a batch meets its deadlines. `OnlineCostModel` fits the same model in a running engine
from its own steps, for a backend with no profile (the torch backend).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import numpy as np


@attrs.frozen(kw_only=True)
class BatchShape:
    """The numbers of a batch that its latency depends on."""

    prefill_tokens: int = 0
    prefill_sq: int = 0
    """Sum over prefill chunks of chunk_len ** 2 (attention among the new tokens)."""
    prefill_prefix: int = 0
    """Sum over prefill chunks of chunk_len * cached_prefix_len (attention to the prefix)."""
    decode_seqs: int = 0
    decode_context: int = 0
    """Sum of decoding sequences' context lengths."""

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]]) -> BatchShape:
        """From (cached tokens before, new tokens) per sequence; one new token is a decode."""
        pt = psq = ppre = ds = dc = 0
        for start, n in chunks:
            if n == 1:
                ds += 1
                dc += start + 1
            else:
                pt += n
                psq += n * n
                ppre += n * start
        return cls(prefill_tokens=pt, prefill_sq=psq, prefill_prefix=ppre, decode_seqs=ds,
                   decode_context=dc)

    def plus(self, start: int, n: int) -> BatchShape:
        """This batch with one more sequence (cached `start` tokens, `n` new)."""
        # built directly: attrs.evolve costs 5x more, and packing calls this per candidate
        if n == 1:
            return BatchShape(prefill_tokens=self.prefill_tokens, prefill_sq=self.prefill_sq,
                              prefill_prefix=self.prefill_prefix, decode_seqs=self.decode_seqs + 1,
                              decode_context=self.decode_context + start + 1)
        return BatchShape(prefill_tokens=self.prefill_tokens + n,
                          prefill_sq=self.prefill_sq + n * n,
                          prefill_prefix=self.prefill_prefix + n * start,
                          decode_seqs=self.decode_seqs, decode_context=self.decode_context)


@attrs.frozen(kw_only=True)
class CopyCost:
    """Time of host <-> device copies (BROS §4.1's swapping model, FastSwitch's copy engine)."""

    bandwidth_gb_per_s: float
    dispatch_us: float
    """CPU cost of issuing one copy call."""

    def copy_ms(self, calls: int, nbytes: int) -> float:
        return calls * self.dispatch_us * 1e-3 + nbytes / (self.bandwidth_gb_per_s * 1e6)


@attrs.frozen(kw_only=True)
class CostModel:
    """Linear iteration-latency model; coefficients in milliseconds."""

    a_ms: float
    """Fixed cost of an iteration (kernel launches, norms, LM head for a tiny batch)."""
    b_ms_per_prefill_token: float
    c_ms_per_prefill_token_sq: float
    d_ms_per_decode_seq: float
    e_ms_per_decode_context_token: float
    f_ms_per_prefill_prefix_token: float = 0.0
    g_ms_multi_row: float = 0.0
    """Added when the step computes more than one token row (P + D > 1): on the CPU torch
    backend one row takes the matrix-vector path, half the time of two rows (a 384 x 8192
    linear: 0.47 vs 0.98 ms, one thread; issue 18 round 3), so one-sequence decode steps run
    well under a + d, and a linear fit without this term charged the 2-4 sequence steps of
    round 2's validation runs 6-14% too little. 0 in profiles not fitted with it."""
    source: str = ""
    """Where the coefficients come from (a profile file, a fit on this machine)."""
    copy: CopyCost | None = None
    """The swap/copy-time model beside it (the backend's host link), if known."""
    block_bytes: int = 0
    """Bytes of one KV block, for `copy`."""

    def predict_iteration_ms(self, shape: BatchShape, copy_blocks: int = 0) -> float:
        """BROS §4.1: an iteration that first brings `copy_blocks` KV blocks back from the
        host (swapped or checkpointed) takes max(model, copy): the copies are asynchronous and
        overlap the model. One copy call per block (a block group would make fewer)."""
        return self.iteration_of(shape.prefill_tokens, shape.prefill_sq, shape.prefill_prefix,
                                 shape.decode_seqs, shape.decode_context, copy_blocks)

    def predict_ms(self, shape: BatchShape) -> float:
        return self.iteration_of(shape.prefill_tokens, shape.prefill_sq, shape.prefill_prefix,
                                 shape.decode_seqs, shape.decode_context)

    def iteration_of(self, prefill_tokens: int, prefill_sq: int, prefill_prefix: int,
                     decode_seqs: int, decode_context: int, copy_blocks: int = 0) -> float:
        """`predict_iteration_ms` of a shape given as its five numbers (`predict_ms` without
        `copy_blocks`): packing tries a shape per candidate request, and building each as a
        BatchShape cost more than the prediction."""
        model = self.model_ms(prefill_tokens, prefill_sq, prefill_prefix, decode_seqs,
                              decode_context)
        if not copy_blocks or self.copy is None:
            return model
        return max(model, self.copy.copy_ms(copy_blocks, copy_blocks * self.block_bytes))

    def model_ms(self, prefill_tokens: int, prefill_sq: int, prefill_prefix: int,
                 decode_seqs: int, decode_context: int) -> float:
        """The model's time alone, no copies (0 for an empty step)."""
        return 0.0 if prefill_tokens == 0 and decode_seqs == 0 else (
            self.a_ms
            + self.b_ms_per_prefill_token * prefill_tokens
            + self.c_ms_per_prefill_token_sq * prefill_sq
            + self.f_ms_per_prefill_prefix_token * prefill_prefix
            + self.d_ms_per_decode_seq * decode_seqs
            + self.e_ms_per_decode_context_token * decode_context
            + (self.g_ms_multi_row if prefill_tokens + decode_seqs > 1 else 0.0))


LLAMA3_8B_A100 = CostModel(
    a_ms=9.712442162952675, b_ms_per_prefill_token=0.07932123916620609,
    c_ms_per_prefill_token_sq=2.339445766408223e-06, d_ms_per_decode_seq=0.050230210848222746,
    e_ms_per_decode_context_token=7.939861013060217e-05,
    f_ms_per_prefill_prefix_token=3.654648737258647e-06,
    source="shared/profiles/vidur/fitted_llama3_8b_a100_iteration_model.json "
           "(variant_with_prefill_context_term), fitted from microsoft/vidur profiling data",
)
"""The default when nothing better is known; profiles (issue 4) provide others."""


def iteration_ms(model_ms: float, swap_ms: float, *, overlapped: bool = True) -> float:
    """One iteration: asynchronous swaps overlap the model (max), synchronous ones add."""
    return max(model_ms, swap_ms) if overlapped else model_ms + swap_ms


COLUMNS = ("a_ms", "b_ms_per_prefill_token", "c_ms_per_prefill_token_sq",
           "d_ms_per_decode_seq", "e_ms_per_decode_context_token", "f_ms_per_prefill_prefix_token",
           "g_ms_multi_row")
_DECODE, _PREFILL, _MULTI_ROW = (0, 3, 4), (1, 2, 5), 6


def features(shape: BatchShape) -> list[float]:
    return [1.0, shape.prefill_tokens, shape.prefill_sq, shape.decode_seqs,
            shape.decode_context, shape.prefill_prefix,
            1.0 if shape.prefill_tokens + shape.decode_seqs > 1 else 0.0]


def nonnegative_fit(x: np.ndarray, y: np.ndarray, active: Sequence[int]) -> np.ndarray:
    """Least squares on relative error over the `active` columns, coefficients >= 0 (a
    negative one is dropped and the rest refitted): more work never predicts less time."""
    coef = np.zeros(x.shape[1])
    active = [i for i in active if np.any(x[:, i] != 0)]
    while active:
        xs = x[:, active] / y[:, None]
        norm = np.linalg.norm(xs, axis=0)  # ms/token^2 is ~1e-6: scale for conditioning
        sol, *_ = np.linalg.lstsq(xs / norm, np.ones_like(y), rcond=None)
        sol = sol / norm
        if np.all(sol >= 0):
            coef[:] = 0
            coef[active] = sol
            return coef
        active = [i for i, v in zip(active, sol) if v >= 0]
    return coef


def fit_coefficients(rows: Sequence[tuple[BatchShape, float]], *, split: bool = True,
                     with_prefix: bool = True, multi_row: bool = False) -> np.ndarray:
    """Coefficients (in COLUMNS order) for `rows` of (shape, measured ms). With `split` and
    enough decode-only and prefill-only rows, the decode model (a, d, e) is fitted on the
    decode-only rows and the prefill model on the prefill-only rows' time above a (BROS §4.1);
    otherwise one joint fit, with `multi_row` also g (when the rows have steps of one token
    row and of more: else g is a again)."""
    x = np.array([features(s) for s, _ in rows], dtype=np.float64)
    y = np.array([ms for _, ms in rows], dtype=np.float64)
    prefill_cols = [i for i in _PREFILL if with_prefix or i != 5]
    decode_only = (x[:, 1] == 0) & (x[:, 3] > 0)
    prefill_only = (x[:, 3] == 0) & (x[:, 1] > 0)
    if split and decode_only.sum() >= 3 and prefill_only.sum() >= 3:
        coef = nonnegative_fit(x[decode_only], y[decode_only], _DECODE)
        rest = y[prefill_only] - coef[0]
        if np.all(rest > 0):
            coef += nonnegative_fit(x[prefill_only], rest, prefill_cols)
            return coef
    single = x[:, _MULTI_ROW] == 0
    extra = [_MULTI_ROW] if multi_row and single.any() and not single.all() else []
    return nonnegative_fit(x, y, list(_DECODE) + prefill_cols + extra)


def model_from(coef: np.ndarray, source: str) -> CostModel:
    return CostModel(**{name: float(v) for name, v in zip(COLUMNS, coef)}, source=source)


class OnlineCostModel:
    """The cost model fitted in a running engine from its own iterations (measured from plan to
    result, so the engine's own overhead is in it): refitted every `refit_every` iterations over
    a window of the latest `window`; starts from `prior` (a profile's model) when given."""

    def __init__(self, prior: CostModel | None = None, *, window: int = 512,
                 refit_every: int = 16, min_rows: int = 8) -> None:
        self.model = prior
        self._rows: list[tuple[BatchShape, float]] = []
        self._window, self._every, self._min = window, refit_every, min_rows
        self._new = 0

    def observe(self, shape: BatchShape, ms: float) -> None:
        if ms <= 0 or (shape.prefill_tokens == 0 and shape.decode_seqs == 0):
            return
        self._rows.append((shape, ms))
        if len(self._rows) > self._window:
            del self._rows[: len(self._rows) - self._window]
        self._new += 1
        if len(self._rows) >= self._min and (self.model is None or self._new >= self._every):
            self._new = 0
            self.model = model_from(self._robust_fit(),
                                    f"fitted in this engine from its last {len(self._rows)} "
                                    f"iterations")

    def _robust_fit(self) -> np.ndarray:
        """Fit, leave out the rows more than 3x the median relative error off (steps slowed by
        a busy neighbour, a copy the shape does not show), fit again."""
        coef = fit_coefficients(self._rows)
        x = np.array([features(s) for s, _ in self._rows], dtype=np.float64)
        y = np.array([ms for _, ms in self._rows], dtype=np.float64)
        rel = np.abs(x @ coef - y) / y
        keep = rel <= 3.0 * max(float(np.median(rel)), 1e-3)
        if keep.sum() >= self._min and not keep.all():
            coef = fit_coefficients([r for r, k in zip(self._rows, keep) if k])
        return coef
