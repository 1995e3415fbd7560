"""A fake model that still needs a correct KV cache: it stores token ids in a block-major "arena"
and computes the next token from the context it reads back through the block table. Any mistake in
block tables, preemption or recompute changes its output, so engine tests compare against
`expected_continuation` exactly."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import attrs

from engine.iteration_log import SwapCounters
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


class StepFailingRunner(KVCheckingRunner):
    """A KVCheckingRunner whose steps listed in `fail_steps` raise `error` instead."""

    def __init__(self, num_blocks: int, block_size: int, *, fail_steps: set[int],
                 error: Exception) -> None:
        super().__init__(num_blocks, block_size)
        self.fail_steps = fail_steps
        self.error = error

    async def step(self, step: ExecuteStep) -> StepFinished:
        if step.step_id in self.fail_steps:
            raise self.error
        return await super().step(step)


class CharCodec:
    """One token per character (its code point): text round-trips exactly, and a token's text
    arrives as soon as the token does."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def detokenizer(self) -> CharDetokenizer:
        return CharDetokenizer()


class CharDetokenizer:
    def add(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    def finish(self) -> str:
        return ""


class FakeSwapper:
    """The swap pool's swapper with no copies: every ticket takes `copy_s` of the engine clock
    from its submission; tickets in `fail` fail with their error when they end."""

    def __init__(self, copy_s: float = 0.01, fail: dict[int, str] | None = None) -> None:
        self.copy_s = copy_s
        self.fail = fail or {}
        self.submitted: list[tuple[int, str, tuple[tuple[int, int], ...], str]] = []
        """(ticket, direction, pairs, granularity) in submission order."""
        self.closed = False
        self._end: dict[int, float] = {}
        self._failures: dict[int, str] = {}
        self._counters = SwapCounters()

    def submit(self, ticket_id: int, direction: str, pairs: Sequence[tuple[int, int]],
               granularity: str) -> None:
        self.submitted.append((ticket_id, direction, tuple(pairs), granularity))
        self._end[ticket_id] = anyio.current_time() + self.copy_s
        c = self._counters
        c.copy_ops += 1
        if direction == "out":
            c.blocks_out += len(pairs)
        else:
            c.blocks_in += len(pairs)

    def poll(self) -> list[int]:
        now = anyio.current_time()
        done = [t for t, end in self._end.items() if end <= now]
        for t in done:
            del self._end[t]
            if t in self.fail:
                self._failures[t] = self.fail[t]
        return done

    def take_failures(self) -> dict[int, str]:
        failures, self._failures = self._failures, {}
        return failures

    def next_poll_s(self) -> float | None:
        if not self._end:
            return None
        return max(0.0, min(self._end.values()) - anyio.current_time())

    def counters(self) -> SwapCounters:
        return attrs.evolve(self._counters)

    def close(self) -> None:
        self.closed = True
