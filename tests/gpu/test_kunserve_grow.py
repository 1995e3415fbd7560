"""A running KunServe pipeline group grows on the torch backend (gpu/group_grow.py): three
instance processes of a tiny 6-layer Llama joined over gloo; instances 0 and 1 form a group
(layers 0-2 | 3-5) with requests in flight, then instance 2 joins it with its own requests in
flight: the split becomes 0-1 | 2-3 | 4-5 (instance 1 takes layer 2 back and drops 4-5, instance 2
drops all but 4-5), every old member re-splits its KV, the layers another member keeps now move
over the data plane, the pool grows, a burst that needs it runs, and the group restores. Every
request equals transformers' greedy output token for token; a seeded request draws what it
draws alone (its generator moves to the new last stage).

The runners are driven by the stand-in scheduler of tests/gpu/kunserve_driver.py. Plants
checked by hand (README, "KunServe ... torch"): an old member that does not write back the KV
of the layers it keeps, and a receiver that skips one chunk of the growth's exchange, each fail
the token comparison.
"""

from __future__ import annotations

import random
import time

import attrs
import pytest
import torch

from engine.cluster.drop_plan import GroupPlan
from engine.cluster.plan import stage_layers
from engine.params import SamplingParams
from gpu.config import ModelConfig
from gpu.group_messages import Adopted
from gpu.stage_view import group_pool_blocks
from tests.conftest import slow_scale
from tests.gpu.kunserve_driver import (
    Req,
    Scheduler,
    left_of,
    random_prompt,
    run_alone,
    running_hosts,
    solo_steps,
)
from tests.reference import assert_matches, greedy_reference

BLOCK = 4
SOLO_BLOCKS = 24
LAYERS = 6
SEEDED = SamplingParams(max_tokens=64, temperature=1.0, seed=4321)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu.make_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("kunserve-6l"), arch="llama",
                              layers=LAYERS, hidden=64, heads=4, kv_heads=2, vocab=320, seed=11)


@pytest.fixture(scope="module")
def hosts(model_dir):
    yield from running_hosts(model_dir, SOLO_BLOCKS, BLOCK, n=3)


def _step(head, sched: Scheduler, **fields) -> None:
    step = sched.next_step()
    if fields:
        step = attrs.evolve(step, **fields)
    done, arrived = head.call("step", step)
    sched.finish(step, done.sampled)
    for rid in arrived:
        sched.reqs[rid].ready = True


def _move(src: Scheduler, dst: Scheduler, owner: int, base: int) -> tuple[list, list]:
    """`src`'s live requests handed over to the head's scheduler (new ids `base` + old)."""
    moved, adopted = [], []
    for r in src.live():
        new = Req(r.name, r.prompt, r.max_tokens, rid=base + r.rid, out=list(r.out),
                  computed=r.computed, ready=False, sampling=r.sampling)
        adopted.append(Adopted(request_id=new.rid, owner=owner, old_request_id=r.rid,
                               kv_tokens=r.computed))
        moved.append((r, new))
        dst.add(new)
    return moved, adopted


def _pool(model_dir, solo: range, stages: int) -> range:
    config = ModelConfig.from_dir(model_dir)
    return range(solo.start, solo.start + group_pool_blocks(
        config, BLOCK, torch.float32, solo.stop, stage_layers(LAYERS, stages)))


@pytest.mark.slow
def test_running_group_grows_to_three_members_equals_transformers(model_dir, hosts):
    (h0, h1, h2), (solo0, solo1, solo2) = hosts
    rng = random.Random(5)
    s0, s1, s2 = (Scheduler(solo, BLOCK) for solo in (solo0, solo1, solo2))
    a = [Req(f"A{i}", random_prompt(rng, 9 + i), 32 - 18 * i, rid=1 + i) for i in range(2)]
    b = [Req(f"B{i}", random_prompt(rng, 7 + i), 14, rid=1 + i) for i in range(2)]
    c = [Req(f"C{i}", random_prompt(rng, 10 + i), 14, rid=1 + i) for i in range(slow_scale(2, 1))]
    seeded = Req("S0", random_prompt(rng, 6), 14, rid=9, sampling=SEEDED)
    for r in a:
        s0.add(r)
    for r in [*b, seeded]:
        s1.add(r)
    for r in c:
        s2.add(r)
    solo_steps([(h0, s0), (h1, s1), (h2, s2)], 3)

    # a group of two: instance 1's requests move to instance 0, KV exchanged (layers 0-2 | 3-5)
    h1.conn.send(("member", 0))
    moved1, adopted1 = _move(s1, s0, 1, 100)
    pool2 = _pool(model_dir, solo0, 2)
    h0.call("expect_adopted", tuple(adopted1))
    s0.grow(pool2)
    for r in a:
        r.ready = False
    plan2 = GroupPlan(group_id=1, members=(0, 1), layers=stage_layers(LAYERS, 2))
    _step(h0, s0, group=plan2, pool_blocks=len(pool2))
    n, since = 0, time.monotonic()
    while not all(r.ready for r in s0.live()) or n < 3:  # pipelined steps; every KV arrived
        worked = any(r.ready and not r.done for r in s0.live())
        _step(h0, s0)
        if worked:  # empty steps (every request waiting for its KV) do not count
            n, since = n + 1, time.monotonic()
        assert time.monotonic() - since < 60 and n < 40, \
            f"the group of two never got every request's KV: {left_of(s0.live())}"
    solo_steps([(h2, s2)], 2)  # instance 2 serves alone meanwhile

    # the group grows: instance 2 hands its requests over and the split becomes three stages
    h2.conn.send(("member", 0))
    moved2, adopted2 = _move(s2, s0, 2, 200)
    plan3 = GroupPlan(group_id=1, members=(0, 1, 2), layers=stage_layers(LAYERS, 3))
    live = sorted(r.rid for r in s0.live())
    pool3, own = h0.call("grow", plan3, tuple(adopted2), live)
    assert pool3 == _pool(model_dir, solo0, 3) and len(pool3) > len(pool2), (pool2, pool3)
    assert set(own) == {r.rid for r in s0.live() if r.table}, own
    s0.grow(pool3)
    s0.free.sort()  # the grown pool's new block ids are handed out first
    for r in s0.live():
        if r.rid in own:
            r.ready = False
    before = {r.name: len(r.out) for r in s0.live()}
    assert {"A0", "B0", "S0", "C0"} <= set(before), before  # in flight as it grows
    _step(h0, s0, group=plan3, pool_blocks=len(pool3))
    burst = [Req(f"D{i}", random_prompt(rng, 12 + i), 6, rid=300 + i) for i in range(slow_scale(4, 2))]
    for r in burst:
        s0.add(r)
    high = set()
    n = 0
    while [r.name for r in s0.live()] != ["A0"] or not all(r.ready for r in s0.live()):
        # every request but the longest ends, and A0's KV arrived (else it is never stepped)
        _step(h0, s0)
        high |= {b for r in s0.live() for b in r.table if b >= pool2.stop}
        n += 1
        assert n < 80, "the grown group never finished its requests"
    assert high, "no request used the grown pool's new blocks"
    after = {r.name: len(r.out) - before[r.name] for r in s0.reqs.values() if r.name in before}
    assert all(k >= 1 for k in after.values()), after  # each went on after the growth
    grown = h0.call("grow_stats")

    # restore: every member's layers back, the head alone again
    moves = s0.shrink(solo0)
    _step(h0, s0, group=GroupPlan(group_id=1, members=(0,), layers=(range(LAYERS),)),
          pool_blocks=len(solo0), moves=moves)
    m1, m2 = h1.answer(), h2.answer()
    print(f"\nkunserve grow: pool {len(pool2)} -> {len(pool3)} blocks; head re-split "
          f"{grown}; member 1 {m1['grown']}; member 2 sent {m2['sent_bytes']} B")
    assert m1["grown"]["kv_sent"] > 0 and m1["grown"]["kv_received"] > 0, m1
    run_alone([(h0, s0)])
    for r, new in moved1 + moved2:
        r.out = new.out
    for r in a + b + c + burst:
        assert_matches(r.out, greedy_reference(model_dir, r.prompt, r.max_tokens), r.name)
    alone = Req("S0 alone", seeded.prompt, seeded.max_tokens, rid=51, sampling=SEEDED)
    s1b = Scheduler(solo1, BLOCK)
    s1b.add(alone)
    run_alone([(h1, s1b)])
    assert seeded.out == alone.out, (seeded.out, alone.out)
