"""The shipped `bros` policy end to end on the torch backend (issue 14, "Correctness"): packing
by slack with the engine's cost model, the adaptive batch size, `preempt swap displace` and the
bidirectional cache, in the tight pool of tests/shunter/test_bidirectional_engine.py (8 blocks
of 8 slots, RT and BE sharing blocks, slow copies, a poisoned host space). The other engine
tests run a plain `precedence rt > be` policy over the same mechanisms; this one runs the
policy users get. Greedy outputs must equal transformers' token for token (near-tie rule), RT
must have overwritten BE slots (checkpointed, then swapped back), and every block and host slot
must be back once idle."""

from __future__ import annotations

import pytest

from policies import policy_path
from tests.shunter.test_bidirectional_engine import BE, made_tables, mismatches, serve

pytestmark = pytest.mark.anyio

COPY_BLOCKS = 20
"""`preempt swap` with the cache on: half of serve()'s 40 host blocks are the copy space."""


async def _run(model_dir, seed: int, *, plant_bug: bool = False):
    with made_tables() as tables:
        run = await serve(model_dir, seed=seed, policy_text=policy_path("bros").read_text(),
                          plant_bug=plant_bug)
    return run, tables[0]


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_shipped_bros_policy_keeps_outputs_equal_to_transformers(tiny_llama_dir):
    """Every run is checked whole; the seed changes (up to three runs) until one swapped
    checkpointed slots back, which timing decides (in 6 probe runs: 23-112 slots checkpointed,
    1-5 swap-back copies each)."""
    for seed in range(3):
        run, mem = await _run(tiny_llama_dir, seed)
        assert len(run.outputs) == 4 * BE
        assert mismatches(tiny_llama_dir, run.outputs) == []
        assert run.snap.scheduler.live_requests == ()
        t = mem.table
        assert t.requests() == [] and t.num_free == 8
        assert t.free_host_slots == (40 - COPY_BLOCKS) * 8
        assert t.free_copy_blocks == COPY_BLOCKS
        if t.checkpointed_slots_total and run.swapper.slot_tickets["in"]:
            return
    pytest.fail(f"in three runs no checkpointed slot was swapped back: "
                f"{t.checkpointed_slots_total} checkpointed, {run.swapper.slot_tickets}")
