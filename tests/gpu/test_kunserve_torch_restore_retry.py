"""KunServe on the torch backend: a restore's step that fails before it changed anything (an
error, not a loss: a prefetched KV round still due after `KV_JOIN_S`, gpu/restore_group.py
`RestoreNotStarted`). Two instance processes of the tiny 4-layer Llama, driven as
tests/gpu/test_kunserve_torch_prefetch.py drives them; the head's fault `join@0` (once) or
`join-always@0` raises where the restore waits for its prefetched rounds.

- Once: the step that carries the engine's plan of one runs on the group instead (none of its
  requests fails), and the next step restores (gpu/kunserve_runner.py `_restore_at`): the
  restored KV equals a prefill, the outputs equal transformers'.
- Every time: after `RESTORE_TRIES` steps the restore is given up: the member is told to write
  its layers from its host copy and serve alone, the head does the same, and the step answers a
  lost group (`GroupLost`: the engine recomputes every request); the outputs still equal
  transformers'.

Before (the reviewer's probe of session 32): the restore's step failed (StepFailed: its
requests ended with the error), the engine, alone already, never sent the plan again, and the
runner went on leading the group: the member never left it.
"""

from __future__ import annotations

import attrs
import pytest

from engine.cluster.drop_plan import GroupPlan
from gpu.kunserve_runner import RESTORE_TRIES
from gpu.restore_group import RESTORE_FAULT_ENV
from tests.gpu.kunserve_driver import (
    group_step,
    hosts_with_env,
    restored_kv_is_a_prefill,
    run_alone,
)
from tests.gpu.test_kunserve_torch_prefetch import (  # noqa: F401 (model_dir: a fixture)
    BLOCK,
    SOLO_BLOCKS,
    _check,
    _grouped,
    _serve_until_ready,
    _shrink,
    model_dir,
)
from tests.gpu.test_kunserve_torch_prefetch_faults import _moved_back


@pytest.fixture(params=["join@0", "join-always@0"])
def hosts_restore_fails(model_dir, request):
    for started in hosts_with_env(model_dir, SOLO_BLOCKS, BLOCK, 2, RESTORE_FAULT_ENV,
                                  request.param):
        yield (*started, request.param)


def test_a_restore_that_fails_before_changing_anything_is_tried_again_or_given_up(
        model_dir, hosts_restore_fails):
    (h0, h1), (solo0, solo1), fault = hosts_restore_fails
    s0, reqs, moved = _grouped(model_dir, h0, h1, solo0, solo1, seed=7)
    _shrink(h0, s0, solo0)
    h0.call("prefetch", "peer")
    _serve_until_ready(h0, s0, worked=2)
    step = attrs.evolve(s0.next_step(), group=GroupPlan(group_id=1, members=(0,),
                                                         layers=(range(4),)),
                        pool_blocks=len(solo0))
    group_step(h0, s0, step)  # (before: its requests failed with the error)
    assert h0.call("ready") is not None, "the restore's step left no group serving"
    if fault == "join@0":
        assert not h1.conn.poll(0.1), "the member left the group while it still serves"
        group_step(h0, s0)  # the restore, tried again
        restored, _ = h0.call("group_stats")
        assert len(restored["failed_tries"]) == 1, restored
        assert "the test's fault" in restored["failed_tries"][0], restored
        assert "abandoned" not in h1.answer(), "the member was not restored"
        restored_kv_is_a_prefill(h0, h1, s0, solo1)
    else:
        for _ in range(RESTORE_TRIES - 2):
            group_step(h0, s0)
        step = s0.next_step()
        h0.conn.send(("step", step))
        kind, message = h0.conn.recv()
        assert kind == "lost", (f"the restore was not given up after {RESTORE_TRIES} tries",
                                kind, message)  # (`GroupLost`: the engine recomputes)
        assert f"restore failed {RESTORE_TRIES} times" in message, message
        member = h1.answer()
        assert "restore failed" in member["abandoned"], member
        rids = h0.call("recover", -1)  # every request the group held: recomputed
        assert sorted(rids) == sorted([r.rid for r in s0.live()] + list(step.release))
        s0.release = list(step.release)  # (the failed step did not hand them over)
        s0.free = list(reversed(solo0))
        for r in s0.live():  # (recomputed: the failed step's tokens were not taken)
            r.table, r.computed, r.reset, r.ready = [], 0, True, True
    run_alone([(h0, s0)])
    _moved_back(reqs, moved)
    _check(model_dir, reqs)
