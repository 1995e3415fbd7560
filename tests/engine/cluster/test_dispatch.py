"""Dispatch rules, table-driven: the policy's `dispatch` statement, the instance each rule picks
from a given state, and the DispatchTable's bookkeeping (in flight, demand, dead instances)."""

from __future__ import annotations

import pytest

from engine.cluster.dispatch import (
    DISPATCH_RULES,
    DispatchTable,
    InstanceStats,
    NoInstanceError,
)
from policy_lang import compile_policy
from shunter import PolicyCheckError


def _table(*, stats: list[tuple[int, int]], in_flight: list[int] = (),
           demand: list[int] = (), down: tuple[int, ...] = ()) -> DispatchTable:
    """stats: (free_blocks, total_blocks) per instance; in_flight / demand: requests already
    dispatched to each (and their tokens)."""
    table = DispatchTable(len(stats), block_size=16)
    for i, (free, total) in enumerate(stats):
        table.report(i, InstanceStats(waiting=0, running=0, swapped=0, free_blocks=free,
                                      total_blocks=total))
    for i, n in enumerate(in_flight):
        for _ in range(n):
            table.dispatched(i, demand[i] if demand else 16)
    for i in down:
        table.down(i, "killed")
    return table


CASES = [
    # rule, state, dispatches before, expected instance
    ("round_robin", dict(stats=[(10, 10)] * 3), 0, 0),
    ("round_robin", dict(stats=[(10, 10)] * 3, in_flight=[1, 1, 0]), 2, 2),
    ("round_robin", dict(stats=[(10, 10)] * 3, in_flight=[1, 1, 1]), 3, 0),
    ("round_robin", dict(stats=[(10, 10)] * 3, down=(1,)), 0, 0),
    ("round_robin", dict(stats=[(10, 10)] * 3, in_flight=[1], down=(1,)), 1, 2),
    ("least_load", dict(stats=[(10, 10)] * 3, in_flight=[2, 1, 3]), 6, 1),
    ("least_load", dict(stats=[(10, 10)] * 3, in_flight=[1, 1, 1], demand=[64, 16, 32]), 3, 1),
    ("least_load", dict(stats=[(10, 10)] * 3, in_flight=[1, 0, 0], down=(1,)), 1, 2),
    ("least_load", dict(stats=[(10, 10)] * 2), 0, 0),
    ("most_free_kv", dict(stats=[(10, 100), (50, 100), (30, 100)]), 0, 1),
    ("most_free_kv", dict(stats=[(10, 20), (50, 200)]), 0, 0),  # a share, not a count
    # blocks promised since the last report count against an instance (50 - 2x3 < 47)
    ("most_free_kv", dict(stats=[(50, 100), (47, 100)], in_flight=[2, 0], demand=[48, 0]), 2, 1),
    ("most_free_kv", dict(stats=[(90, 100), (50, 100)], down=(0,)), 0, 1),
    ("most_free_kv", dict(stats=[(50, 100), (50, 100)], in_flight=[1, 0], demand=[1, 0]), 1, 1),
]


@pytest.mark.parametrize("rule,state,before,expected", CASES)
def test_each_rule_picks_the_instance_its_table_says(rule, state, before, expected):
    table = _table(**state)
    assert table.dispatches == before
    policy = compile_policy(f"policy p {{ dispatch {rule} }}", filename="p.policy")
    assert table.choose(DISPATCH_RULES[policy.settings.dispatch]) == expected


def test_a_policy_without_dispatch_runs_round_robin():
    assert compile_policy("policy p { }", filename="p.policy").settings.dispatch == "round_robin"


def test_an_unknown_rule_is_refused_where_it_is_written():
    with pytest.raises(PolicyCheckError) as err:
        compile_policy("policy p {\n  dispatch least_lod\n}", filename="p.policy")
    assert str(err.value).splitlines()[0] == (
        "p.policy:2:12: unknown dispatch rule 'least_lod'; did you mean 'least_load'? "
        "(rules: round_robin, least_load, most_free_kv, freeness)")


def _report(table, i, *, free, running, waiting=0, queued_blocks=0):
    table.report(i, InstanceStats(waiting=waiting, running=running, swapped=0, free_blocks=free,
                                  total_blocks=12660, queued_tokens=queued_blocks * 16))


def test_freeness_sends_to_the_most_free_blocks_per_request():
    """Llumnix's freeness: free KV blocks after the queued requests' over the batch. A group's
    head with thousands of free blocks but a large batch against instances alone and nearly
    full: memory per request decides, not the request count (least_load) nor the free share."""
    table = DispatchTable(3, block_size=16)
    _report(table, 0, free=100, running=8, waiting=2)  # 10 blocks a request
    _report(table, 1, free=1000, running=40, waiting=10, queued_blocks=200)  # 800 / 50 = 16
    _report(table, 2, free=30, running=2)  # 15
    rule = DISPATCH_RULES["freeness"]
    assert table.choose(rule) == 1
    assert table.choose(DISPATCH_RULES["least_load"]) == 0
    for _ in range(10):  # sent since the report: their blocks and their count (790 / 60 = 13.2)
        table.dispatched(1, 16)
    assert table.choose(rule) == 2
    _report(table, 0, free=10, running=5, waiting=5, queued_blocks=500)  # (10 - 500) / 10 < 0
    assert table.choose(rule) == 2
    _report(table, 0, free=5, running=0)  # no requests: infinitely free
    assert table.choose(rule) == 0
    policy = compile_policy("policy p { dispatch freeness }", filename="p.policy")
    assert DISPATCH_RULES[policy.settings.dispatch] is rule
    assert "(Llumnix's freeness)" in policy.explain()


def test_ended_requests_leave_the_count_and_a_dead_cluster_refuses():
    table = _table(stats=[(10, 10)] * 2, in_flight=[2, 0], demand=[32, 0])
    table.ended(0, 32)
    views = table.views()
    assert (views[0].in_flight, views[0].queued_tokens) == (1, 32)
    table.down(0, "instance 0 died (exit code -9)")
    table.down(1, "instance 1 died (exit code 1)")
    with pytest.raises(NoInstanceError, match=r"every instance of the cluster is down "
                       r"\(instance 0: instance 0 died \(exit code -9\); instance 1: "):
        table.choose(DISPATCH_RULES["least_load"])


def test_explain_says_where_requests_go():
    from policy_lang import compile_policy as compile_

    text = compile_("policy p { dispatch most_free_kv }", filename="p.policy").explain()
    assert text.rstrip().endswith("Dispatch (a cluster): each new request goes to the live "
                                  "instance with the largest free share of its KV pool.")
    assert "Dispatch" not in compile_("policy p { }", filename="p.policy").explain()
