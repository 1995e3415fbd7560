"""BROS chaos on the torch backend (issue 14): clients cancel requests at awkward moments in the
tight pool of tests/shunter/test_bidirectional_engine.py (8 blocks of 8 slots, RT and BE sharing
blocks, copies slowed, the host space poisoned), under asyncio and trio, with the plain
`precedence rt > be` policy (preempt recompute) and the shipped `bros` (preempt swap displace).
tests/sim/chaos_bros.py's `Watch` checks every fit against a model of the slots and cancels
requests right after a fit left them displaced, swapped out, sharing a block, overwriting or
with their swap-back in flight (the copies then still run); other clients give up at a random
time or leave after some tokens. Afterwards every admitted request ended once with its client's
reason, the table, host slots, copy space and swap pool are back to empty, and every token a
client read, of a finished request or a cancelled one, is transformers' greedy token (near-tie
rule): the survivors' KV was not hurt by what the cancelled ones left behind."""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Iterator

import pytest

from engine.memory.bidirectional import BidirectionalBlocks, decode
from policies import policy_dir, policy_path
from policy_lang import compile_policy
from shunter import Engine, EngineConfig
from tests.conftest import slow_scale
from tests.gpu.swap_doubles import PoisonedHostSwapper, torch_backend
from tests.reference import TIE_GAP, greedy_reference
from tests.shunter.test_bidirectional_engine import POLICY, VOCAB
from tests.sim.chaos_bros import Client, Watch, canceller, client_errors, drive, watching

pytestmark = pytest.mark.anyio

MAX_TOKENS = 12


def clients_for(seed: int) -> list[Client]:
    rng = random.Random(seed)
    be = [Client(f"be {i}", [rng.randrange(2, VOCAB) for _ in range(rng.choice([21, 30, 40]))],
                 "be", MAX_TOKENS, start_s=0.0) for i in range(6)]
    rt = [Client(f"rt {i}", [rng.randrange(2, VOCAB) for _ in range(rng.choice([3, 9, 17]))],
                 "rt", MAX_TOKENS, start_s=0.01 + 0.02 * i) for i in range(12)]
    for c in be + rt:  # a quarter give up at a random time, a quarter leave after some tokens
        if (u := rng.random()) < 0.25:
            c.cancel_after_s = rng.uniform(0.0, 0.4)
        elif u < 0.5:
            c.stop_after_tokens = rng.randint(1, MAX_TOKENS - 1)
    return be + rt


def wrong_tokens(model_dir, clients: list[Client]) -> list[str]:
    """Tokens a client read that are not transformers' greedy ones (a near-tie's second choice
    allowed, and nothing compared past it); a request that ran to its end has all of them."""
    bad = []
    for c in clients:
        ref = greedy_reference(model_dir, c.prompt, c.max_tokens)
        for k, got in enumerate(c.tokens):
            if k >= len(ref.tokens) or got != ref.tokens[k]:
                best, second, gap = ref.top2[k] if k < len(ref.tokens) else (None, None, 1.0)
                if not (gap <= TIE_GAP and got == second):
                    bad.append(f"{c.label}: step {k}: engine {got}, reference "
                               f"{ref.tokens[k] if k < len(ref.tokens) else None}")
                break
        else:
            if c.finish in ("stop", "length") and len(c.tokens) != len(ref.tokens):
                bad.append(f"{c.label}: {len(c.tokens)} tokens, reference {len(ref.tokens)}")
    return bad


async def chaos(model_dir, seed: int, policy_text: str) -> tuple[Watch, list[Client]]:
    config = EngineConfig(model=model_dir, num_blocks=8, block_size=8, max_batched_tokens=64,
                          max_num_seqs=16, cpu_swap_blocks=40)
    policy = compile_policy(policy_text, base_dir=policy_dir())
    backend = torch_backend(config, functools.partial(PoisonedHostSwapper, copy_delay_s=0.002))
    watch, clients = Watch(random.Random(seed), cancel_p=0.25), clients_for(seed)
    with watching(watch):
        async with Engine.start(config, policy=policy, backend=backend) as engine:
            watch.cancel = canceller(clients)
            watch.client = await drive(engine, clients)
            watch.errors = client_errors(clients)
            await engine.wait_idle()
    return watch, clients


@pytest.mark.parametrize("policy", ["recompute", "bros"])
async def test_cancels_at_awkward_moments_leave_survivors_correct_and_nothing_leaked(
        tiny_llama_dir, policy):
    """Probe runs (seeds 0-3, both loops, load ~5): 46-117 fits, 1-70 slots checkpointed, 8-17
    of the 18 requests cancelled, 0-7 of them by `Watch` in each awkward state, 0.3-1 s each."""
    text = POLICY if policy == "recompute" else policy_path("bros").read_text()
    left = 0
    for seed in range(slow_scale(6, 2)):
        watch, clients = await chaos(tiny_llama_dir, seed, text)
        assert watch.fits > 0 and len(watch.admitted) == len(clients)
        assert watch.errors + watch.endings(watch.client) + watch.leftovers() == []
        assert wrong_tokens(tiny_llama_dir, clients) == []
        left += sum(c.left for c in clients)
    # clients left (a quarter leave after k < MAX_TOKENS tokens, unless their request stopped
    # at an EOS first); how many of the others ran to their end is up to timing
    assert left > 0


@contextlib.contextmanager
def shared_blocks_freed_with_their_be_owner() -> Iterator[None]:
    """A planted bug: a BE request that ends (cancelled, here, mostly) while it shares a block
    with an RT request gives that block back to the free list as well, though RT still writes
    and reads it; the next request to take it overwrites RT's KV."""
    free = BidirectionalBlocks.free

    def planted(self, rid):
        s = self._seqs[rid]
        shared = [b for b, _ in map(decode, s.table) if s.reverse and self._blocks[b].rt >= 0]
        free(self, rid)
        self._free.extend(shared)

    BidirectionalBlocks.free = planted
    try:
        yield
    finally:
        BidirectionalBlocks.free = free


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_shared_block_freed_with_its_be_owner_shows_in_outputs_and_checks(
        tiny_llama_dir):
    """The plant above must show in the survivors' tokens (and in the checks): in probe runs it
    did on the first seed every time; the seed changes until it does, up to four runs."""
    for seed in range(4):
        with shared_blocks_freed_with_their_be_owner():
            watch, clients = await chaos(tiny_llama_dir, seed, POLICY)
        if wrong_tokens(tiny_llama_dir, clients):
            assert watch.leftovers(), "the checks missed what the outputs show"
            return
    pytest.fail("in four runs no shared block freed with its BE owner changed an output")
