"""KunServe on the torch backend, faults around a prefetched restore (gpu/restore_kv.py): two
instance processes of the tiny 4-layer Llama, driven as tests/gpu/test_kunserve_torch_prefetch.py
drives them.

- A member's step fails (an error, not a loss) while the prefetch's KV rounds run: the member
  still sends that step's round (zeros in its place), the head voids it and names its blocks
  again, and the group serves on to a restore whose KV equals a prefill. Before (the review of
  session 31): the member's chunk numbers stayed a round behind the head's, the prefetch never
  became ready, the restore's step waited 60 s for a chunk that never came, named the live
  member lost, and its recovery crashed (`no layers are dropped`).
- The head's own step fails (an error, not a loss) while the KV rounds run: it sends the member
  zeros for the activations it owed, reads the member's answer before it raises, and the group
  serves on level. Before: the member's answer to the failed step stayed unread and answered
  the next step instead.
- A member lost at the restore's step once it sent everything (its weights back: the head's
  model is whole again): the head recomputes every request. Before: its recovery restored
  layers no longer dropped and crashed.
"""

from __future__ import annotations

import pytest

from gpu.data_plane import FAULT_ENV
from gpu.group_stage import STEP_FAULT_ENV
from tests.gpu.kunserve_driver import (
    end_the_failed,
    fail_a_victims_step,
    hosts_with_env,
    restored_kv_is_a_prefill,
    run_alone,
)
from tests.gpu.test_kunserve_torch_prefetch import (  # noqa: F401 (model_dir: a fixture)
    BLOCK,
    SOLO_BLOCKS,
    _check,
    _grouped,
    _partial_block_bytes,
    _restore,
    _serve_until_ready,
    _shrink,
    model_dir,
)


def _hosts_with(model_dir, env: str, value: str):
    """Two instances started with `env` set to `value` (a test fault)."""
    yield from hosts_with_env(model_dir, SOLO_BLOCKS, BLOCK, 2, env, value)


@pytest.fixture(params=["kv-round@1", "step@0"])
def hosts_step_fails(model_dir, request):
    """A step that carries a KV round fails once (not a loss): instance 1's once it ran
    (`kv-round@1`), or the head's own before its first microbatch (`step@0`)."""
    for started in _hosts_with(model_dir, STEP_FAULT_ENV, request.param):
        yield (*started, request.param)


@pytest.fixture
def hosts_lost_at_restore(model_dir):
    """Instance 1 kills itself at the restore's step once it sent its KV and weights."""
    yield from _hosts_with(model_dir, FAULT_ENV, "restore-sent@1")


def _moved_back(reqs, moved) -> None:
    for r, new in moved:
        r.out = new.out


def test_a_member_step_failing_while_kv_rounds_run_leaves_the_restore_whole(
        model_dir, hosts_step_fails):
    (h0, h1), (solo0, solo1), fault = hosts_step_fails
    s0, reqs, moved = _grouped(model_dir, h0, h1, solo0, solo1, seed=4)
    _shrink(h0, s0, solo0)
    h0.call("prefetch", "peer")
    victim, others, step, message = fail_a_victims_step(h0, s0, BLOCK)
    assert "the test's fault" in message and "lost" not in message, message
    assert ("member instance" not in message) == (fault == "step@0"), message  # (whose)
    assert {w.request_id for w in step.seqs} == {victim.rid}, step.seqs
    end_the_failed(s0, victim, others)
    _serve_until_ready(h0, s0, worked=2)  # (before: never ready; it failed here after 120 s)
    partial = _partial_block_bytes(model_dir, s0)
    restored, _ = _restore(h0, h1, s0, solo0)
    restored_kv_is_a_prefill(h0, h1, s0, solo1)
    assert restored["kv_bytes_at"] == partial, restored  # (every round in, none misread)
    run_alone([(h0, s0)])
    _moved_back(reqs, moved)
    _check(model_dir, [r for r in reqs if r.rid != victim.rid])


def test_a_member_lost_at_the_restores_step_after_its_weights_came_back(
        model_dir, hosts_lost_at_restore):
    (h0, h1), (solo0, solo1) = hosts_lost_at_restore
    s0, reqs, moved = _grouped(model_dir, h0, h1, solo0, solo1, seed=5)
    _shrink(h0, s0, solo0)
    h0.call("prefetch", "peer")
    _serve_until_ready(h0, s0, worked=2)
    live = sorted(r.rid for r in s0.live())
    try:
        _restore(h0, h1, s0, solo0)
    except RuntimeError as exc:  # (the step's answer: "lost", raised by Host.call)
        message = str(exc)
    else:
        raise AssertionError("the restore's step went through with its member gone")
    assert "lost" in message.split(":", 2)[1] and "member instance 1 was lost" in message, \
        message
    h1.proc.join(timeout=60)
    assert not h1.proc.is_alive()
    rids = h0.call("recover", 1)  # the head serves alone; every request is recomputed
    assert sorted(rids) == live, (rids, live)
    s0.release = []  # (the restore's step let its releases go)
    s0.free = list(reversed(solo0))
    for r in s0.live():
        r.table, r.computed, r.reset, r.ready = [], 0, True, True
    run_alone([(h0, s0)])
    _moved_back(reqs, moved)
    _check(model_dir, reqs)
