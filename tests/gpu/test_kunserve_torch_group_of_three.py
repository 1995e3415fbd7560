"""KunServe on the torch backend, a group of three instance processes (the tiny 4-layer Llama
split 2 / 1 / 1 over gloo), driven by the stand-in scheduler (tests/gpu/kunserve_driver.py):
both members hand their requests to the head, a burst runs pipelined, the head's pool shrinks
back and the restore is prefetched (two members' KV rounds, each on its own receiving thread),
and then the middle member's step fails (an error, not a loss: `SHUNTER_GROUP_STEP_FAULT=step@1`,
before its first microbatch).

The middle member takes the head's activations and sends the last member zeros for those it
owed (gpu/group_stage.py `_level_activations`), so the last member's step ends too; the head
reads both answers before it raises the middle one's error (gpu/group_runner.py `_answers`).
The group serves on to a restore whose KV equals a prefill; the other requests' outputs equal
transformers'. About 17 s at load 4.

Plants (session 32): no zeros sent: 'lost: pipeline group member instance 2 was lost while step
12 ran: TimeoutError: no answer in 60 s' (the last member waited for activations that never
came); the head stops reading answers at the first error: 'lost: pipeline group member instance
2 was lost while step 12 was sent: ... Connection closed by peer' (its unread answer).
"""

from __future__ import annotations

import random

import pytest

from gpu.group_stage import STEP_FAULT_ENV
from tests.gpu.kunserve_driver import (
    Req,
    Scheduler,
    adopt_live,
    end_the_failed,
    fail_a_victims_step,
    form_group,
    group_steps,
    hosts_with_env,
    random_prompt,
    restored_kv_is_a_prefill,
    run_alone,
    solo_steps,
)
from tests.gpu.test_kunserve_torch_prefetch import (  # noqa: F401 (model_dir: a fixture)
    BLOCK,
    SOLO_BLOCKS,
    _check,
    _partial_block_bytes,
    _restore,
    _serve_until_ready,
    _shrink,
    model_dir,
)

LAYERS3 = (range(2), range(2, 3), range(3, 4))


@pytest.fixture
def hosts3(model_dir):
    """Three instances; instance 1's first step carrying a KV round fails once."""
    yield from hosts_with_env(model_dir, SOLO_BLOCKS, BLOCK, 3, STEP_FAULT_ENV, "step@1")


def _grouped3(model_dir, hosts, solos):
    """Each instance serves two requests alone, then 1 and 2 join 0's group with theirs and a
    burst runs through it until done (as test_kunserve_torch_prefetch.py `_grouped`)."""
    rng = random.Random(8)
    scheds = [Scheduler(solo, BLOCK) for solo in solos]
    for k, s in enumerate(scheds):
        for i in range(2):
            s.add(Req(f"{'ABC'[k]}{i}", random_prompt(rng, 7 + 2 * k + i),
                      (20 if k == 0 else 16) if i == 0 else 6, rid=10 * k + 1 + i))
    solo_steps(list(zip(hosts, scheds)), 3)
    moved, adopted = [], []
    for k in (1, 2):
        hosts[k].conn.send(("member", 0))
        m, a = adopt_live(scheds[0], scheds[k], owner=k)
        moved += m
        adopted += a
    s0 = scheds[0]
    form_group(model_dir, hosts[0], s0, (0, 1, 2), adopted, solos[0], LAYERS3)
    burst = [Req(f"D{i}", random_prompt(rng, 8 + i), 5, rid=40 + i) for i in range(3)]
    for r in burst:
        s0.add(r)
    group_steps(hosts[0], s0, lambda: all(r.done for r in burst)
                and all(r.table for r in s0.live()))
    reqs = [r for r in scheds[0].reqs.values() if r.rid < 100] + [new for _, new in moved]
    return s0, reqs, moved


def test_a_middle_members_failed_step_levels_the_last_and_the_group_serves_on(
        model_dir, hosts3):
    (h0, h1, h2), solos = hosts3
    s0, reqs, moved = _grouped3(model_dir, (h0, h1, h2), solos)
    _shrink(h0, s0, solos[0])
    h0.call("prefetch", "peer")
    victim, others, step, message = fail_a_victims_step(h0, s0, BLOCK)
    assert "member instance 1: RuntimeError: the test's fault" in message, message
    assert "lost" not in message, message
    assert {w.request_id for w in step.seqs} == {victim.rid}, step.seqs
    end_the_failed(s0, victim, others)
    _serve_until_ready(h0, s0, worked=2)
    partial = _partial_block_bytes(model_dir, s0)  # (the members' layers: 2 of 4, as in 2)
    restored, _ = _restore(h0, h1, s0, solos[0])
    assert "abandoned" not in h2.answer(), "the last member did not restore"
    restored_kv_is_a_prefill(h0, h1, s0, solos[1])
    assert restored["kv_bytes_at"] == partial, restored  # (every round in, none misread)
    assert restored["kv_recv_threads"] == 2, "one receiving thread a member, all rounds"
    run_alone([(h0, s0)])
    for r, new in moved:
        r.out = new.out
    _check(model_dir, [r for r in reqs if r.rid != victim.rid])
