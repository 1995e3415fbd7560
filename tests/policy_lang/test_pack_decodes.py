"""Packing tries running requests' decodes in `PackOrder._take` itself, `_try` written out for
one token of a running request (the scheduler's time per iteration, issue 14). It must decide
exactly as `_try` does for every request: the same batch, order, rest and predicted
violation, on random queues of RT and BE decodes, prompts, swapped requests and checkpoints,
with and without a cost model and a bidirectional table. `Batch.min_slack_without` skips its
pass where another request holds the minimum: it must equal the pass."""

from __future__ import annotations

import math

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cost_model import LLAMA3_8B_A100, CopyCost
from policies import policy_path
from policy_lang import load_policy_file
from policy_lang.pack_batch import Batch
from policy_lang.packing import LATE, STOP, TAKEN, PackOrder
from tests.factories import NOW, make_scheduler_view, make_view

COST = attrs.evolve(LLAMA3_8B_A100, copy=CopyCost(bandwidth_gb_per_s=25.0, dispatch_us=1500.0),
                    block_bytes=1 << 17)  # 1.5 ms a block: copies compete with the model
BS = 16


class EveryRequestTried(PackOrder):
    """Packing as before the decode path: `_try` for every request, decodes included."""

    def _take(self, batch, step, group, lender, rank):
        left, late, stopped = [], [], False
        decode = [r.remaining_tokens == 1 and r.state == "running" for r in group]
        decodes = sum(decode)
        for i, r in enumerate(group):
            decodes -= decode[i]
            if batch.full():
                left += group[i:]
                break
            if r.id in lender.claimed:
                left.append(r)
                continue
            remaining = r.remaining_tokens
            if remaining > 1:
                batch.decode_reserve = max(0, min(decodes, batch.limit - len(batch.selected) - 1))
            verdict = self._try(batch, step, r, remaining, lender, rank, False)
            if verdict is TAKEN:
                continue
            if verdict is LATE:
                late.append((r, remaining))
            elif verdict is STOP:
                stopped = True
                left += group[i:]
                break
            else:
                left.append(r)
        batch.decode_reserve = 0
        for r, n in late:
            if (stopped or batch.full()
                    or self._try(batch, step, r, n, lender, rank, True) is not TAKEN):
                left.append(r)
        return left


@st.composite
def request(draw, rid: int):
    rt = draw(st.booleans())
    kind = draw(st.sampled_from(["decode", "decode", "decode", "chunk", "waiting", "swapped"]))
    prompt = draw(st.one_of(st.integers(1, 200), st.integers(1, 1200)))
    output = 0 if kind in ("waiting", "chunk") else draw(st.integers(1, 300))
    context = prompt + output
    computed = {"decode": context - 1, "chunk": draw(st.integers(0, prompt - 1)),
                "waiting": 0, "swapped": context - 1}[kind]
    blocks = 0 if kind in ("waiting", "swapped") else -(-computed // BS) + draw(st.integers(-1, 1))
    return make_view(
        id=rid, request_class="rt" if rt else "be", ttft_ms=400.0 if rt else None,
        tpot_ms=200.0 if rt else None, state="waiting" if kind == "waiting" else
        "swapped" if kind == "swapped" else "running", prompt_tokens=prompt, output_tokens=output,
        computed_tokens=computed, blocks=max(0, blocks),
        swapped_blocks=-(-computed // BS) if kind == "swapped" else 0,
        checkpointed_blocks=0 if rt or kind == "swapped" else draw(st.integers(0, 2)),
        deadline=NOW + draw(st.floats(-0.05, 0.3)) if rt else math.inf,
        arrival=float(draw(st.integers(0, 5))))


@st.composite
def queue(draw):
    n = draw(st.integers(0, 40))
    return [draw(request(rid)) for rid in range(1, n + 1)]


@settings(max_examples=250, deadline=None)
@given(requests=queue(), name=st.sampled_from(["bros", "bros_no_bicache"]),
       free=st.one_of(st.integers(0, 30), st.integers(0, 300)),
       reverse=st.one_of(st.none(), st.integers(0, 100)),
       tokens=st.sampled_from([64, 512, 2048]), limit=st.integers(1, 48),
       cost=st.sampled_from([COST, None]), average_ms=st.sampled_from([0.0, 30.0]))
def test_the_decode_path_packs_exactly_as_trying_every_request(requests, name, free, reverse,
                                                               tokens, limit, cost, average_ms):
    view = make_scheduler_view(requests, free_blocks=free, block_size=BS,
                               reverse_free_blocks=reverse, max_batched_tokens=tokens, cost=cost)
    policy = load_policy_file(policy_path(name))
    fast = policy.parts["order"]
    slow = EveryRequestTried(split=fast._split, sort=fast._sort, steps=fast._steps,
                             env=fast._env, timer=fast._timer)
    out = []
    for order in (fast, slow):
        order._timer.average_ms = average_ms
        order._env.begin(view)
        got = order(view, limit)
        out.append(([r.id for r in got], order.batch, order.violated))
    assert out[0] == out[1]


@settings(max_examples=200, deadline=None)
@given(budgets=st.lists(st.sampled_from([-5.0, 0.0, 3.0, 3.0, 7.5, math.inf]), max_size=12),
       removals=st.lists(st.integers(0, 11), max_size=6))
def test_min_slack_without_a_request_is_the_minimum_over_the_others(budgets, removals):
    batch = Batch(make_scheduler_view([]), None, 0.0, 64)
    for k, budget in enumerate(budgets):
        batch.add(make_view(id=k + 1), 0, (0, 1), 0, budget, 0, [0, 0, 0, 1, 1], 0)
    for i in removals:
        entries = batch.entries
        assert batch.min_slack == min((e[3] for e in entries), default=math.inf)
        if not entries:
            break
        i %= len(entries)
        others = min((e[3] for j, e in enumerate(entries) if j != i), default=math.inf)
        assert batch.min_slack_without(i, entries[i][3]) == others
        batch.remove(i)
        assert batch.min_slack == others
