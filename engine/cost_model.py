"""Iteration latency as a function of the batch's shape (BROS §4.1; vidur-style composition).

    t_ms = a + b*P + c*sum(p_i^2) + f*sum(p_i*prefix_i) + d*D + e*sum(ctx_j)

P: prefill tokens; p_i: chunk length of prefill i and prefix_i the tokens cached before it;
D: decoding sequences; ctx_j: context length of decode j. The simulator waits this long for a
step; policies use it to predict whether a batch meets its deadlines.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs


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
        if n == 1:
            return attrs.evolve(self, decode_seqs=self.decode_seqs + 1,
                                decode_context=self.decode_context + start + 1)
        return attrs.evolve(self, prefill_tokens=self.prefill_tokens + n,
                            prefill_sq=self.prefill_sq + n * n,
                            prefill_prefix=self.prefill_prefix + n * start)


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
    source: str = ""
    """Where the coefficients come from (a profile file, a fit on this machine)."""

    def predict_ms(self, shape: BatchShape) -> float:
        if shape.prefill_tokens == 0 and shape.decode_seqs == 0:
            return 0.0
        return (self.a_ms
                + self.b_ms_per_prefill_token * shape.prefill_tokens
                + self.c_ms_per_prefill_token_sq * shape.prefill_sq
                + self.f_ms_per_prefill_prefix_token * shape.prefill_prefix
                + self.d_ms_per_decode_seq * shape.decode_seqs
                + self.e_ms_per_decode_context_token * shape.decode_context)


LLAMA3_8B_A100 = CostModel(
    a_ms=9.712442162952675, b_ms_per_prefill_token=0.07932123916620609,
    c_ms_per_prefill_token_sq=2.339445766408223e-06, d_ms_per_decode_seq=0.050230210848222746,
    e_ms_per_decode_context_token=7.939861013060217e-05,
    f_ms_per_prefill_prefix_token=3.654648737258647e-06,
    source="shared/profiles/vidur/fitted_llama3_8b_a100_iteration_model.json "
           "(variant_with_prefill_context_term), fitted from microsoft/vidur profiling data",
)
"""The default when nothing better is known; profiles (issue 4) provide others."""
