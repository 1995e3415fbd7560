"""KunServe's cost model (§4.3 Eq. 1-3) fitted per pipeline stage from the microbatches a group
really ran, and the cut of a step into microbatches that a real pipeline group sends its
members (the torch backend's; the simulator fits the same model to its profile, sim/group.py).

`StageFits` keeps, for each stage, the recent microbatches it ran as (chunks, milliseconds
measured), refits Eq. 1-3 by least squares (engine/cluster/lookahead.py `fit_chunk_cost`) after
each step, and before adding a step's microbatches predicts them with the fit it had: those
predictions against the times then measured are the model's prediction error (held out: a
microbatch never predicts itself). The same is done for a token-count model (ms = a + b x
tokens, least squares), the baseline the paper compares with (Figure 15).

`seed` gives a stage its first samples from a profile's prediction for the whole model times the
stage's share of the layers (offline profiling, as the paper fits its hyperparameters before
serving; a torch engine with a `cost_profile`), so the first steps of a group are cut by a fit.

`cut` cuts a step's work: `lookahead` balances the microbatches' predicted cost over the whole
step (`lookahead_split`, with the stages' fits summed: a microbatch's trip through every
stage), cutting prefill chunks where the balance falls; until every stage has
`min_samples` measured microbatches it balances tokens the same way (`TOKEN_COUNT`). `tokens`
keeps whole sequences in microbatches of about equal tokens (engine/cluster/plan.py
`split_microbatches`, what the group did before lookahead). `pieces` turns a cut back into
the step's `SeqWork`: a piece of a prefill samples only if it ends where its sequence's work
ends.
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from engine.cluster.lookahead import (
    TOKEN_COUNT,
    Chunk,
    ChunkCost,
    TokenLine,
    fit_chunk_cost,
    fit_token_line,
    lookahead_split,
)
from engine.cluster.plan import split_microbatches
from engine.messages import SeqWork

Cut = tuple[tuple[Chunk, ...], ...]
"""Microbatches in order, each a tuple of (index in the step's seqs, start, tokens)."""


def step_chunks(seqs: Sequence[SeqWork]) -> list[Chunk]:
    """The step's work as chunks, prefills before decodes (the order the groups cut in)."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].num_tokens == 1)
    return [(i, seqs[i].start, seqs[i].num_tokens) for i in order]


def pieces(seqs: Sequence[SeqWork], cut: Cut) -> list[list[SeqWork]]:
    """Each microbatch's `SeqWork`: piece (i, start, n) of `seqs[i]`, sampling only at the end
    of `seqs[i]`'s work."""
    out = []
    for mb in cut:
        work = []
        for i, start, n in mb:
            w = seqs[i]
            work.append(SeqWork(request_id=w.request_id, start=start, num_tokens=n,
                                sample=w.sample and start + n == w.start + w.num_tokens))
        out.append(work)
    return out


def check_cut(seqs: Sequence[SeqWork], cut: Cut) -> None:
    """Every token of every sequence's work in exactly one piece, in order, none empty."""
    seen: dict[int, int] = {}
    for mb in cut:
        if not mb:
            raise ValueError("a microbatch of the cut is empty")
        for i, start, n in mb:
            w = seqs[i]
            if n < 1 or start != seen.get(i, w.start):
                raise ValueError(f"the cut's piece ({i}, {start}, {n}) of request {w.request_id}"
                                 f" does not follow its previous piece")
            seen[i] = start + n
    for i, w in enumerate(seqs):
        if seen.get(i, w.start) != w.start + w.num_tokens:
            raise ValueError(f"the cut leaves tokens of request {w.request_id} out "
                             f"({seen.get(i, w.start)} of [{w.start}, "
                             f"{w.start + w.num_tokens}) computed)")


@attrs.define
class StageFits:
    stages: int
    min_samples: int = 8
    window: int = 256
    """Most recent microbatches kept per stage (older ones age out of the fit)."""
    samples: list[deque] = attrs.field(init=False)
    """Measured microbatches per stage: (chunks as (start, tokens), ms)."""
    seeds: list[list] = attrs.field(init=False)
    """Per stage, `seed`'s profile samples: fitted with the measured ones until a stage has
    measured half a window, then left out (the profile times a whole engine step; measured
    microbatches of a few steps, mostly decodes, do not pin the attention terms down)."""
    fits: list[ChunkCost | None] = attrs.field(init=False)
    token_fits: list[TokenLine | None] = attrs.field(init=False)
    errors: list[float] = attrs.field(factory=list)
    """|predicted - measured| / measured, per stage and microbatch, with the fit of the time."""
    token_errors: list[float] = attrs.field(factory=list)
    cuts: int = 0
    """Steps cut by the fitted model (the others: by tokens)."""
    split_chunks: int = 0
    """Prefill chunks the cuts divided between microbatches."""

    def __attrs_post_init__(self) -> None:
        self.samples = [deque(maxlen=self.window) for _ in range(self.stages)]
        self.seeds = [[] for _ in range(self.stages)]
        self.fits = [None] * self.stages
        self.token_fits = [None] * self.stages

    @property
    def fitted(self) -> bool:
        return all(f is not None for f in self.fits)

    def model(self) -> ChunkCost:
        """A microbatch's cost through every stage (the stages' fits summed)."""
        if not self.fitted:
            return TOKEN_COUNT
        return ChunkCost(**{k: sum(getattr(f, k) for f in self.fits)
                            for k in ("alpha", "beta", "gamma", "delta")})

    def cut(self, seqs: Sequence[SeqWork], parts: int, mode: str, *,
            min_tokens: int = 1) -> Cut:
        chunks = step_chunks(seqs)
        if mode == "tokens":
            out = split_microbatches(chunks, parts, [c[2] for c in chunks])
        elif mode == "lookahead":
            fitted = self.fitted
            out = lookahead_split(chunks, parts, self.model(), min_tokens=min_tokens)
            self.cuts += fitted
            self.split_chunks += sum(len(mb) for mb in out) - len(chunks)
        else:
            raise ValueError(f"microbatch mode {mode!r}: expected 'tokens' or 'lookahead'")
        return tuple(tuple(mb) for mb in out)

    def seed(self, whole_ms: Callable[[list[tuple[int, int]]], float],
             shares: Sequence[float], *, max_context: int, samples: int = 64,
             seed: int = 0) -> None:
        """Offline profiling (§4.3: the hyperparameters are fitted before serving): random
        microbatches (75% decodes, 25% prefill chunks, up to `max_context` tokens) timed by
        `whole_ms` (a profile's prediction for the whole model, milliseconds) times each
        stage's share of the layers, as each stage's first samples; measured microbatches
        replace them as they come (the window keeps the most recent)."""
        if len(shares) != self.stages:
            raise ValueError(f"{len(shares)} shares for {self.stages} stages")
        rng = random.Random(seed)
        top = max(2, max_context - 1)
        for _ in range(samples):
            chunks = []
            for _ in range(rng.randint(1, 32)):
                if rng.random() < 0.75:
                    chunks.append((rng.randint(1, top - 1), 1))
                else:
                    n = rng.randint(2, min(top, 2048))
                    chunks.append((rng.choice([0, rng.randint(0, top - n)]), n))
            ms = whole_ms(chunks)
            for s, share in enumerate(shares):
                self.seeds[s].append((chunks, ms * share))
        for s in range(self.stages):
            self._refit(s)

    def observe(self, cut: Cut, stage_ms: Sequence[Sequence[float]]) -> None:
        """The step's microbatches ran: stage s spent `stage_ms[s][m]` on microbatch m."""
        if len(stage_ms) != self.stages:
            raise ValueError(f"{len(stage_ms)} stages measured, {self.stages} fitted")
        batches = [[(s, n) for _, s, n in mb] for mb in cut]
        for s, row in enumerate(stage_ms):
            fit, tok = self.fits[s], self.token_fits[s]
            for chunks, ms in zip(batches, row):
                if ms <= 0:
                    continue
                if fit is not None:
                    self.errors.append(abs(fit.batch_ms(chunks) - ms) / ms)
                if tok is not None:
                    self.token_errors.append(abs(tok.batch_ms(chunks) - ms) / ms)
                self.samples[s].append((chunks, ms))
            self._refit(s)

    def _refit(self, s: int) -> None:
        data = list(self.samples[s])
        if len(data) < self.window // 2:
            data = self.seeds[s] + data
        if len(data) >= self.min_samples:
            self.fits[s] = fit_chunk_cost(data)
            self.token_fits[s] = fit_token_line(data)

    def report(self) -> dict:
        def stats(xs: list[float]) -> dict:
            if not xs:
                return {"n": 0}
            return {"n": len(xs), "mean": statistics.fmean(xs), "median": statistics.median(xs),
                    "p90": sorted(xs)[int(0.9 * (len(xs) - 1))]}

        return {"samples": [len(d) for d in self.samples], "fitted": self.fitted,
                "cuts_by_fit": self.cuts, "split_chunks": self.split_chunks,
                "error": stats(self.errors), "tokens_model_error": stats(self.token_errors),
                "fit": None if not self.fitted else attrs.asdict(self.model())}

