"""A workload: a seeded, deterministic list of requests to submit (open loop) plus closed-loop
sources (BE batches: a new batch when the last one completes). Every policy in one
`shunter bench` run gets the very same workload."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import attrs

from shunter.workloads.tokens import TokenIds, extend_context


@attrs.frozen(kw_only=True)
class RequestSpec:
    """One request of a workload."""

    index: int
    """Unique within the workload; open-loop requests are 0..n-1 in arrival order."""
    arrival_s: float
    """Seconds after the workload starts; a later turn also waits for its parent (below)."""
    prompt_tokens: int
    output_tokens: int
    """Exact output length: submitted as `max_tokens` with `ignore_eos`."""
    request_class: str = "rt"
    """Class label for metrics; sent to the engine only when the policy declares it."""
    tenant: str = "default"
    conversation_id: str | None = None
    priority: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    parent: int | None = None
    """Index of an earlier request whose context (its prompt, then its output) this prompt
    starts with."""
    shared_tokens: int = 0
    """How many tokens of the parent's context this prompt starts with."""
    after_parent_s: float | None = None
    """A later turn of a conversation: submitted no sooner than this long after its parent
    finishes (it needs the parent's output). None: it does not wait for the parent."""

    @property
    def needs_parent_output(self) -> bool:
        return self.parent is not None and self.after_parent_s is not None


@attrs.frozen(kw_only=True)
class BatchSource:
    """BROS's best-effort batches (§7.1, after FlexGen): `batch_size` requests with prompts
    uniform in `prompt_range` and outputs uniform in `output_range`, all submitted at once; the
    next batch when every request of the last one has finished."""

    batch_size: int
    prompt_range: tuple[int, int] = (512, 1024)
    output_range: tuple[int, int] = (32, 128)
    request_class: str = "be"
    start_s: float = 0.0
    stop_s: float | None = None
    """No new batch starts after this (seconds after the workload starts)."""
    max_batches: int | None = None
    seed: int = 0
    first_index: int = 1 << 40
    """Indices of its requests start here (apart from the open-loop ones)."""
    tenant: str = "batch"
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def batch(self, k: int, scale: float = 1.0) -> list[RequestSpec]:
        """The k-th batch (0-based), the same for every run with the same seed."""
        rng = random.Random(f"{self.seed}/be/{k}")
        out = []
        for j in range(self.batch_size):
            p = scaled(rng.randint(*self.prompt_range), scale)
            o = scaled(rng.randint(*self.output_range), scale)
            out.append(RequestSpec(
                index=self.first_index + k * self.batch_size + j, arrival_s=0.0,
                prompt_tokens=p, output_tokens=o, request_class=self.request_class,
                tenant=self.tenant, ttft_ms=self.ttft_ms, tpot_ms=self.tpot_ms))
        return out


def scaled(n: int, factor: float) -> int:
    return max(1, round(n * factor)) if factor != 1.0 else n


@attrs.frozen(kw_only=True)
class Workload:
    name: str
    description: str
    params: dict[str, Any]
    """The spec's keys with defaults filled in (reported in the bench JSON)."""
    requests: tuple[RequestSpec, ...]
    batches: tuple[BatchSource, ...] = ()
    duration_s: float = 0.0
    """Length of the arrival window (the last open-loop arrival when the spec gives none)."""
    length_scale: float = 1.0
    """`scale_lengths`, applied to closed-loop batches as they are generated."""
    seed: int = 0

    def describe(self) -> dict[str, Any]:
        rs = self.requests
        return {
            "name": self.name, "description": self.description, "params": self.params,
            "requests": len(rs), "closed_loop_sources": len(self.batches),
            "duration_s": self.duration_s,
            "mean_prompt_tokens": sum(r.prompt_tokens for r in rs) / len(rs) if rs else 0,
            "mean_output_tokens": sum(r.output_tokens for r in rs) / len(rs) if rs else 0,
            "later_turns": sum(r.needs_parent_output for r in rs),
            "shared_prefix_requests": sum(r.parent is not None for r in rs),
        }

    def prompt(self, spec: RequestSpec, vocab: int, parent_context: Sequence[int] | None) -> TokenIds:
        """The prompt's ids, within `vocab`: a prefix of the parent's context when it has one,
        then ids seeded by the request (so every run sees the same prompts)."""
        low = 3 if vocab > 64 else 0  # keep clear of the usual special ids (pad, bos, eos)
        seed = (self.seed << 40) ^ spec.index
        if parent_context is not None and spec.shared_tokens:
            return extend_context(parent_context, spec.shared_tokens, spec.prompt_tokens, seed,
                                  vocab, low)
        return TokenIds.random(seed, spec.prompt_tokens, vocab, low)


def window(specs: Sequence[RequestSpec], *, start: float, duration: float | None,
           cap: int | None) -> list[RequestSpec]:
    """Requests arriving in [start, start + duration), shifted to start at 0, at most `cap`;
    a request whose parent falls outside loses the link (and its shared prefix)."""
    end = math.inf if duration is None else start + duration
    kept = [s for s in specs if start <= s.arrival_s < end]
    if cap is not None:
        kept = kept[:cap]
    return renumber(kept, shift=start)


def renumber(specs: Sequence[RequestSpec], *, shift: float = 0.0) -> list[RequestSpec]:
    new_index = {s.index: i for i, s in enumerate(specs)}
    out = []
    for i, s in enumerate(specs):
        parent = new_index.get(s.parent) if s.parent is not None else None
        link: dict[str, Any] = {} if parent is not None else dict(shared_tokens=0,
                                                                   after_parent_s=None)
        out.append(attrs.evolve(s, index=i, arrival_s=s.arrival_s - shift, parent=parent, **link))
    return out


def rescale(specs: Sequence[RequestSpec], *, time: float = 1.0, lengths: float = 1.0,
            max_input: int | None = None, max_output: int | None = None) -> list[RequestSpec]:
    """Arrivals divided by `time` (replay k times faster); lengths multiplied by `lengths` and
    capped. A capped prompt keeps at most its length of the parent's context."""
    out = []
    for s in specs:
        p = scaled(s.prompt_tokens, lengths)
        o = scaled(s.output_tokens, lengths)
        shared = scaled(s.shared_tokens, lengths) if s.shared_tokens else 0
        if max_input is not None:
            p = min(p, max_input)
        if max_output is not None:
            o = min(o, max_output)
        out.append(attrs.evolve(s, arrival_s=s.arrival_s / time, prompt_tokens=p, output_tokens=o,
                                shared_tokens=min(shared, p)))
    return out
