"""A fake model that still needs a correct KV cache: it stores token ids in a block-major "arena"
and computes the next token from the context it reads back through the block table. Any mistake in
block tables, preemption or recompute changes its output, so engine tests compare against
`expected_continuation` exactly."""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from engine.messages import ExecuteStep, SampledToken, StepFinished
from shunter.backends import Backend

VOCAB = 97
EOS = 3


def next_token(context: Sequence[int]) -> int:
    h = 17
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def expected_continuation(prompt: Sequence[int], max_tokens: int, stop: set[int] = frozenset()) -> list[int]:
    ctx, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(ctx)
        ctx.append(t)
        out.append(t)
        if t in stop:
            break
    return out


class KVCheckingRunner:
    def __init__(self, num_blocks: int, block_size: int, step_delay: float = 0.0) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.slots = [-1] * (num_blocks * block_size)
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.step_delay = step_delay
        self.steps = 0

    async def start(self) -> range:
        return range(self.num_blocks)

    async def step(self, step: ExecuteStep) -> StepFinished:
        if self.step_delay:
            await anyio.sleep(self.step_delay)
        self.steps += 1
        for rid in step.release:
            self.tokens.pop(rid, None)
            self.tables.pop(rid, None)
        for s in step.setups:
            self.tokens[s.request_id] = list(s.prompt_ids)
            self.tables[s.request_id] = []
        for u in step.blocks:
            if u.reset:
                self.tables[u.request_id] = []
            self.tables[u.request_id].extend(u.append)
        sampled = []
        bs = self.block_size
        for w in step.seqs:
            table, toks = self.tables[w.request_id], self.tokens[w.request_id]
            for p in range(w.start, w.start + w.num_tokens):
                self.slots[table[p // bs] * bs + p % bs] = toks[p]
            if w.sample:
                end = w.start + w.num_tokens
                context = [self.slots[table[p // bs] * bs + p % bs] for p in range(end)]
                tok = next_token(context)
                toks.append(tok)
                sampled.append(SampledToken(request_id=w.request_id, token_id=tok))
        return StepFinished(step_id=step.step_id, sampled=tuple(sampled), compute_s=0.0)


def fake_backend(num_blocks: int = 64, block_size: int = 4, step_delay: float = 0.0,
                 max_context: int = 4096) -> Backend:
    return Backend(runner=KVCheckingRunner(num_blocks, block_size, step_delay), codec=None,
                   vocab_size=VOCAB, eos_token_ids=(EOS,), max_context=max_context,
                   max_prompt_tokens=max_context - 1)
