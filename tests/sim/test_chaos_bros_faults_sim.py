"""A slot copy that fails inside BROS's memory mechanisms (issue 14), on the simulator: the
schedules of tests/sim/test_chaos_bros_sim.py with the copier's k-th transfer failing
(`SimSwapper.fail_transfers`, reported as the torch swapper reports a copy that raised: the
step that waits for it fails with "swap ticket N failed: ...", and the swap pool's `SwapDone`
names the ticket's request). The model of the slots (tests/sim/chaos_bros.py `TagModel`) holds
no one's KV in the slots the failed transfer was to write, so a request whose table still
points there (a BE request checkpointed for an RT one, a victim swapped out, one swapped back
that then left the step) fails the next fit's check unless it was recomputed
(engine/bidirectional_step.py `step_failed`). The torch backend's version, with real tokens
compared against transformers': tests/shunter/test_chaos_bros_faults.py."""

from __future__ import annotations

import random

import pytest

from engine.bidirectional_step import BidirectionalMemory
from tests.conftest import slow_scale
from tests.sim.chaos_bros import Watch
from tests.sim.test_chaos_bros_sim import POLICIES, run

ERROR = "injected copy failure"


def failing(seed: int, policy: str, *, cancel_p: float = 0.0) -> Watch:
    """One run of the 10-block pool with one transfer failing: the k-th, k seeded in 1-20 (the
    runs copy 8-54 times)."""
    k = random.Random(f"{seed} {policy}").randint(1, 20)
    return run(seed, policy, blocks=10, cancel_p=cancel_p, fail_transfers=frozenset({k}))


def problems(watch: Watch) -> list[str]:
    """What went wrong besides the injected failure's own clear error."""
    out = watch.errors + watch.leftovers()
    for rid in watch.admitted:
        ends = watch.ended.get(rid, [])
        if len(ends) != 1:
            out.append(f"request {rid} ended {len(ends)} times: {ends}")
        elif ends[0][0] == "error" and ERROR not in (ends[0][1] or ""):
            out.append(f"request {rid} failed otherwise: {ends[0][1]}")
        elif ends[0][0] not in ("stop", "length", "cancelled", "error"):
            out.append(f"request {rid} ended {ends[0][0]}")
        elif rid in watch.aborted_live and ends[0][0] not in ("cancelled", "error"):
            out.append(f"request {rid} was cancelled while live but ended {ends[0][0]}")
    return out


@pytest.mark.parametrize("cancel_p", [0.0, 0.3])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(slow_scale(40, 8)))
def test_a_failed_slot_copy_fails_its_step_and_leaves_no_request_pointing_at_lost_kv(
        policy, seed, cancel_p):
    watch = failing(seed, policy, cancel_p=cancel_p)
    assert watch.fits > 0 and watch.admitted
    assert problems(watch) == []


def test_the_failures_reach_requests_and_their_recompute():
    """The runs above are not vacuous: over seeds 0-7 without cancels, the injected transfer
    failed in most runs, failed requests with the error, and `step_failed` recomputed some
    requests outside the failed step."""
    copies = errors = recomputed = 0
    for policy in POLICIES:
        for seed in range(8):
            watch = failing(seed, policy)
            copies += watch.failed_copies
            errors += sum(1 for ends in watch.ended.values() if ends[0][0] == "error")
            recomputed += watch.memories[0].recomputed_after_failures
    assert copies >= 8 and errors > 0 and recomputed > 0, (copies, errors, recomputed)


def test_without_the_recompute_a_request_points_at_lost_kv(monkeypatch):
    """The plant: `step_failed` recomputes nothing. Some run's check must then find a request
    whose checkpoint or live slot the failed copy never wrote."""
    monkeypatch.setattr(BidirectionalMemory, "step_failed", lambda self, *a: [])
    found = [p for policy in POLICIES for seed in range(8) for p in problems(failing(seed, policy))]
    assert any("does not hold its KV" in p or "lost its KV" in p for p in found), found
