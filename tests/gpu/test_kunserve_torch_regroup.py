"""A pipeline group broken while its KV exchange runs leaves gloo operations posted that gloo
cannot cancel: here the head's chunks for the surviving member stay queued behind chunks for a
member that went away, and the survivor's receives for them stay posted after it left the
group. A later group between the same two instances must not have its chunks taken by those
receives: each group exchanges over a channel of its own (gpu/data_plane.py `open_channel`: a
process group over a store prefix no other group uses), so nothing of a broken group can match
a later group's messages.

Three instance processes of the tiny 4-layer model (tests/gpu/kunserve_driver.py), driven by a
stand-in scheduler. Before the channels (and with the planted bug: `open_channel` returning a
channel over the world's process group) the survivor's stale receive takes the second group's
first chunk, sized for the first group's split: gloo aborts the survivor's process
(`Received data size doesn't match expected size`) and the head loses it in the second group's
first step (`member instance 2 was lost while step 7 was sent`). A chunk of the same size would
leave the survivor waiting for ever for the one its stale receive took: a step not answered
within `STEP_WAIT_S` fails the test.
"""

from __future__ import annotations

import random
import time

import attrs
import pytest
import torch

from engine.cluster.drop_plan import GroupPlan
from gpu.config import ModelConfig
from gpu.stage_view import group_pool_blocks
from tests.gpu.kunserve_driver import Req, Scheduler, start_hosts
from tests.reference import assert_matches, greedy_reference

BLOCK = 4
SOLO_BLOCKS = 24
STEP_WAIT_S = 30.0
"""A group step that takes longer than this fails the test (a chunk that never comes)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu.make_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("kunserve-regroup"), arch="llama",
                              layers=4, hidden=64, heads=4, kv_heads=2, vocab=320, seed=7)


@pytest.fixture
def hosts(model_dir):
    hosts = start_hosts(model_dir, SOLO_BLOCKS, BLOCK, n=3)
    ranges = [range(*h.answer(timeout=180)) for h in hosts]
    yield hosts, ranges
    for h in hosts:
        if h.proc.is_alive():
            h.proc.kill()
        h.proc.join(timeout=10)


def _steps(host, sched: Scheduler, n: int | None = None) -> None:
    """`n` steps (None: until every request is done, then one to hand over the releases). An
    empty step (every request still waits for its KV) asks the members for arrivals; the KV
    must come within `STEP_WAIT_S` (however many empty steps that takes)."""
    k, worked, waiting_since = 0, 0, time.monotonic()
    while (n is None and sched.live()) or (n is not None and k < n):
        step = sched.next_step()
        done, arrived = host.call("step", step, timeout=STEP_WAIT_S)
        sched.finish(step, done.sampled)
        for rid in arrived:
            sched.reqs[rid].ready = True
        k += 1
        if step.seqs:
            worked, waiting_since = worked + 1, time.monotonic()
        assert time.monotonic() - waiting_since < STEP_WAIT_S, "no request's KV arrived"
        assert worked < 80, "the requests never finished"
    if n is None:
        step = sched.next_step()
        host.call("step", step, timeout=STEP_WAIT_S)


def _plan_step(model_dir, sched: Scheduler, solo: range, ranks, layers):
    config = ModelConfig.from_dir(model_dir)
    pool = range(solo.start, solo.start + group_pool_blocks(config, BLOCK, torch.float32,
                                                            solo.stop, layers))
    sched.grow(pool)
    for r in sched.live():  # their KV for the members' layers is exchanged
        r.ready = False
    return attrs.evolve(sched.next_step(), group=GroupPlan(group_id=1, members=tuple(ranks),
                                                            layers=tuple(layers)),
                        pool_blocks=len(pool))


def test_a_group_after_one_broken_mid_exchange_gets_its_own_chunks(model_dir, hosts):
    (h0, h1, h2), (solo0, _, _) = hosts
    rng = random.Random(5)
    s0 = Scheduler(solo0, BLOCK)
    reqs = [Req(f"A{i}", [rng.randrange(2, 320) for _ in range(9 + 3 * i)], 24, rid=1 + i)
            for i in range(3)]
    for r in reqs:
        s0.add(r)
    _steps(h0, s0, 2)

    # group (0, 1, 2): member 1 goes away as soon as the group starts, before it takes any of
    # the head's chunks; the head queued its chunks for member 2 behind them, so member 2's
    # receives for them stay posted when the head gives the group up
    h1.conn.send(("die_after_go", 0))
    h2.conn.send(("member", 0))
    step = _plan_step(model_dir, s0, solo0, (0, 1, 2), (range(1), range(1, 2), range(2, 4)))
    h0.conn.send(("step", step))
    assert h0.conn.poll(STEP_WAIT_S)
    kind, message = h0.conn.recv()
    assert kind == "lost" and "member instance 1 was lost" in message, (kind, message)
    left = h2.answer(timeout=STEP_WAIT_S)
    assert "member instance 1" in left["abandoned"], left
    h1.proc.join(timeout=10)

    # the head recomputes its requests alone (every KV was lost with the group)
    s0.free = list(reversed(solo0))
    for r in s0.live():
        r.table, r.computed, r.reset, r.ready = [], 0, True, True
    _steps(h0, s0, 3)

    # group (0, 2): the survivor takes layers 2-3 again, the head's chunks for them come in the
    # same order as before (the stale receives would take the first of them)
    h2.conn.send(("member", 0))
    step = _plan_step(model_dir, s0, solo0, (0, 2), (range(2), range(2, 4)))
    done, arrived = h0.call("step", step, timeout=STEP_WAIT_S)
    s0.finish(step, done.sampled)
    for rid in arrived:
        s0.reqs[rid].ready = True
    _steps(h0, s0)
    member = None
    restore = attrs.evolve(s0.next_step(), group=GroupPlan(group_id=2, members=(0,),
                                                            layers=(range(4),)),
                           pool_blocks=len(solo0), moves=s0.shrink(solo0))
    h0.call("step", restore, timeout=STEP_WAIT_S)
    member = h2.answer(timeout=STEP_WAIT_S)
    assert member.get("chunks_received", 0) >= len(reqs), member
    for r in reqs:
        assert_matches(r.out, greedy_reference(model_dir, r.prompt, r.max_tokens), r.name)
