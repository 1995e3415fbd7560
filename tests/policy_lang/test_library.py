"""The shipped policies: each passes `shunter policy check`, and each has table-driven decisions
(a frozen scheduler view in, the expected order / max_batch / displace / overload out)."""

from __future__ import annotations

import itertools
import math
import re

import attrs
import pytest

from engine.cost_model import CostModel
from engine.policy import IterationOutcome
from policies import available, policy_dir, policy_path
from policy_lang import load_policy_file
from shunter.cli import main
from tests.factories import make_scheduler_view, make_view

SHIPPED = ["bros", "bros_no_bicache", "fastswitch_markov", "fastswitch_random", "fcfs", "groups_markov",
           "groups_random", "kunserve", "kunserve_drop", "kunserve_exchange",
           "kunserve_lookahead", "priority", "reuse_markov", "reuse_random",
           "round_robin_rtbe", "rtbe_classes", "vllm_baseline_markov", "vllm_baseline_random",
           "vllm_prefix_markov", "vllm_prefix_random", "vllm_v0", "vtc"]

# iteration time = 10 ms + 1 ms per decoding sequence + 0.1 ms per prefill token
COST = CostModel(a_ms=10.0, b_ms_per_prefill_token=0.1, c_ms_per_prefill_token_sq=0.0,
                 d_ms_per_decode_seq=1.0, e_ms_per_decode_context_token=0.0)


def load(name: str):
    return load_policy_file(policy_path(name))


def decode(id: int, **kw) -> object:
    """A running request about to decode its next token."""
    return make_view(id=id, state="running", computed_tokens=10, output_tokens=1, blocks=1, **kw)


def ids(decision) -> list[int]:
    return [r.id for r in decision.order]


def test_the_library_is_what_the_issue_names():
    assert available() == SHIPPED


def test_every_shipped_policy_passes_check(capsys):
    files = [str(policy_dir() / f"{n}.policy") for n in SHIPPED]
    assert main(["policy", "check", *files]) == 0
    assert capsys.readouterr().out == "".join(f"{f}: ok\n" for f in files)


CITED = {  # the paper sections each file's header comment cites, in order
    "bros": ["BROS §4.2", "§4.1", "§4.2", "§7.1", "§5"],
    "bros_no_bicache": ["BROS §7.4.1"],
    "fastswitch_markov": ["FastSwitch §3", "§4", "§3.2"],
    "fastswitch_random": ["FastSwitch §3", "§4", "§3.2"],
    "fcfs": ["FastSwitch §4", "BROS §7.1", "KunServe §5"],
    "groups_markov": ["FastSwitch §4", "§3.1"],
    "groups_random": ["FastSwitch §4", "§3.1"],
    "kunserve": ["KunServe §4", "§4.4", "§5", "§3"],
    "kunserve_drop": ["KunServe §5.3", "§4.1", "§2.2"],
    "kunserve_exchange": ["KunServe §5.3", "§4.2"],
    "kunserve_lookahead": ["KunServe §5.3", "§4.3"],
    "priority": ["FastSwitch §2.2"],
    "reuse_markov": ["FastSwitch §4", "§3.3"],
    "reuse_random": ["FastSwitch §4", "§3.3"],
    "round_robin_rtbe": ["BROS §2.2", "§7.1"],
    "rtbe_classes": ["BROS §7.1"],
    "vllm_baseline_markov": ["FastSwitch §4", "§4"],
    "vllm_baseline_random": ["FastSwitch §4"],
    "vllm_prefix_markov": ["FastSwitch §4"],
    "vllm_prefix_random": ["FastSwitch §4"],
    "vllm_v0": ["BROS §7", "§2.2", "§6"],
    "vtc": ["FastSwitch §2.2"],
}


def test_each_file_names_the_paper_section_it_follows():
    assert sorted(CITED) == SHIPPED
    for name, sections in CITED.items():
        lines = policy_path(name).read_text().splitlines()
        header = " ".join(line[1:] for line in itertools.takewhile(lambda x: x.startswith("#"), lines))
        assert re.findall(r"(?:(?:FastSwitch|BROS|KunServe) )?§[\d.]+", header) == sections, name


# ------------------------------------------------------------------------- ordering tables

TABLES = {
    "fcfs": [  # (requests, expected ids, max_batch, displace)
        ([make_view(id=1, arrival=3.0), make_view(id=2, arrival=1.0), make_view(id=3, arrival=2.0)],
         [2, 3, 1], None, False),
    ],
    "kunserve": [
        ([make_view(id=1, arrival=3.0), make_view(id=2, arrival=1.0)], [2, 1], None, False),
    ],
    "rtbe_classes": [  # a fragment on its own: its classes, arrival order, classes mixed
        ([make_view(id=1, request_class="rt", arrival=2.0), make_view(id=2, request_class="be",
                                                                      arrival=1.0)],
         [2, 1], None, False),
    ],
    "priority": [
        ([make_view(id=1, priority=0, arrival=1.0), make_view(id=2, priority=2, arrival=3.0),
          make_view(id=3, priority=2, arrival=2.0), make_view(id=4, priority=1, arrival=0.5)],
         [3, 2, 4, 1], None, True),
    ],
}


@pytest.mark.parametrize(("name", "case"), [(n, c) for n, cases in TABLES.items() for c in cases])
def test_stateless_policies_order_as_the_table_says(name, case):
    requests, want, max_batch, displace = case
    d = load(name).decide(make_scheduler_view(requests))
    assert (ids(d), d.max_batch, d.displace, d.overload) == (want, max_batch, displace, None)


def test_vtc_serves_the_least_served_tenant_first_and_lifts_a_returning_one():
    policy = load("vtc")
    a1, b1 = make_view(id=1, tenant="a", arrival=1.0), make_view(id=2, tenant="b", arrival=2.0)
    assert ids(policy.decide(make_scheduler_view([a1, b1]))) == [1, 2]
    policy.observe(IterationOutcome(iteration=1, duration_ms=5.0, served=[(a1, 10, 1)],
                                    deadline_misses=0))  # a: 10 * 1 + 1 * 2
    a2 = make_view(id=3, tenant="a", arrival=3.0)
    assert ids(policy.decide(make_scheduler_view([a1, b1, a2]))) == [2, 1, 3]
    # c arrives while a (12) and b (0) are active: it starts at b's count, not below it
    c1 = make_view(id=4, tenant="c", arrival=4.0)
    policy.observe(IterationOutcome(iteration=2, duration_ms=5.0, served=[(b1, 3, 1)],
                                    deadline_misses=0))  # b: 5
    assert ids(policy.decide(make_scheduler_view([a1, b1, a2, c1]))) == [2, 4, 1, 3]
    assert policy.parts["fair"].service == {"a": 12.0, "b": 5.0, "c": 5.0}


def test_round_robin_alternates_rt_and_be_and_passes_an_empty_turn():
    policy = load("round_robin_rtbe")
    rt = [make_view(id=1, request_class="rt", arrival=2.0), make_view(id=2, request_class="rt", arrival=1.0)]
    be = [make_view(id=3, request_class="be", arrival=0.5), make_view(id=4, arrival=0.1)]  # 4: no class
    view = make_scheduler_view(rt + be)
    assert [ids(policy.decide(view)) for _ in range(3)] == [[2, 1], [4, 3], [2, 1]]
    only_be = make_scheduler_view(be)
    assert [ids(policy.decide(only_be)) for _ in range(2)] == [[4, 3], [4, 3]]


def waiting(id: int, prompt: int, **kw) -> object:
    return make_view(id=id, state="waiting", prompt_tokens=prompt, **kw)


BROS = [
    # (requests, view overrides, expected batch, expected rest of the order, predicted violation)
    ("calm: every RT fits, BE fill stops at the deadline, then BE replaces slack-rich RT",
     [decode(1, request_class="rt", slack_ms=100.0), decode(2, request_class="rt", slack_ms=30.0),
      decode(3, request_class="rt", slack_ms=14.0), decode(4, request_class="be", checkpointed_blocks=2),
      decode(5, request_class="be", checkpointed_blocks=0)],
     {}, [3, 5, 4], [2, 1], False),
    ("tight: the second RT would make the first miss, so packing stops and predicts a violation",
     [decode(1, request_class="rt", slack_ms=11.5), decode(2, request_class="rt", slack_ms=12.0),
      decode(3, request_class="be")],
     {}, [1], [2, 3], True),
    ("late: an RT request that cannot make its deadline is served after those that can",
     [decode(1, request_class="rt", slack_ms=-40.0), decode(2, request_class="rt", slack_ms=50.0),
      decode(3, request_class="be")],
     {}, [2, 1, 3], [], False),
    # 1,500 prompt tokens in 512-token chunks: 3 iterations of 61 ms, more than its 150 ms slack,
    # though one iteration alone would fit: the constraint is over the remaining iterations
    ("iterations: a prompt needing more iterations than its slack allows goes after one that fits",
     [waiting(1, 1500, request_class="rt", slack_ms=150.0),
      waiting(2, 100, request_class="rt", slack_ms=300.0)],
     {}, [2, 1], [], False),
    # §4.1 bounds a batch by B requests and the iteration time, not tokens: a 600-token prompt
    # chunk leaves a token each for the decodes behind it (510 + 1 + 1) instead of taking all
    # 512 and leaving them out; decodes lead the batch, as the planner gives tokens in its order
    ("decodes: a prompt chunk leaves one token for each decode behind it",
     [waiting(1, 600, request_class="rt", slack_ms=300.0),
      decode(2, request_class="rt", slack_ms=1000.0), decode(3, request_class="rt", slack_ms=2000.0)],
     {}, [2, 3, 1], [], False),
    ("memory: an RT prompt that does not fit is skipped and the BE request behind it runs",
     [waiting(1, 100, request_class="rt", slack_ms=300.0), waiting(2, 20, request_class="be")],
     {"free_blocks": 2}, [2], [], False),
    # FindPreemptBlock skips the request that does not fit; it does not end the RT pass (a
    # decode behind it needs no new block and still runs)
    ("skip: an RT prompt that does not fit leaves the RT decode behind it in the batch",
     [waiting(1, 100, request_class="rt", slack_ms=300.0),
      decode(2, request_class="rt", slack_ms=1000.0)],
     {"free_blocks": 2}, [2], [], False),
    ("reserve: a newer RT prompt may not take the blocks an older one waits for; BE may",
     [waiting(1, 100, request_class="rt", slack_ms=300.0),
      waiting(2, 20, request_class="rt", slack_ms=350.0), waiting(3, 20, request_class="be")],
     {"free_blocks": 2}, [3], [], False),
    ("lender: an RT prompt takes the blocks of a running BE request left out of the batch",
     [waiting(1, 100, request_class="rt", slack_ms=300.0),
      make_view(id=2, request_class="be", state="running", blocks=10, computed_tokens=150,
                prompt_tokens=150, output_tokens=1),
      waiting(3, 20, request_class="be")],
     {"free_blocks": 2}, [1], [2], False),
]


def batch_ids(decision) -> list[int]:
    return [r.id for r in decision.order[:decision.batch]]


@pytest.mark.parametrize("case", BROS, ids=[c[0].split(":")[0] for c in BROS])
def test_bros_packs_by_slack_and_predicted_iteration_time(case):
    _, requests, overrides, want, rest, violated = case
    policy = load("bros")
    d = policy.decide(make_scheduler_view(requests, cost=COST, **overrides))
    assert (batch_ids(d), ids(d)[d.batch:], d.max_batch, d.displace) == (want, rest, 8, True)
    assert policy.parts["order"].violated is violated


def test_bros_batch_size_grows_while_calm_and_resets_on_a_violation():
    policy = load("bros")
    calm = make_scheduler_view([decode(1, request_class="rt", slack_ms=100.0)], cost=COST)
    tight = make_scheduler_view([decode(1, request_class="rt", slack_ms=11.5),
                                 decode(2, request_class="rt", slack_ms=12.0)], cost=COST)
    outcome = IterationOutcome(iteration=1, duration_ms=12.0, served=[], deadline_misses=0)
    limits = []
    for view in (calm, calm, calm, tight, calm):
        limits.append(policy.decide(view).max_batch)
        policy.observe(outcome)
    late = attrs.evolve(outcome, deadline_misses=1)
    policy.decide(calm)
    policy.observe(late)
    assert limits == [8, 16, 24, 32, 8]  # +8 a calm iteration (bros_round10e_a10_be.md)
    # §4.2 resets on the estimate: a late token alone (overload) does not shrink the batch
    assert policy.decide(calm).max_batch == 24


def test_bros_without_a_cost_model_predicts_the_moving_average():
    from policy_lang import compile_policy

    policy = compile_policy('policy one extends "bros.policy" { batch max 1 }',
                            base_dir=policy_dir())
    requests = [decode(1, request_class="rt", slack_ms=100.0), decode(2, request_class="be")]
    # nothing observed yet: 0 ms predicted, so BE replaces the RT request (100 ms > 2 * 0 ms)
    assert batch_ids(policy.decide(make_scheduler_view(requests))) == [2]
    policy.observe(IterationOutcome(iteration=1, duration_ms=60.0, served=[], deadline_misses=0))
    assert policy.parts["timer"].average_ms == 60.0
    assert batch_ids(policy.decide(make_scheduler_view(requests))) == [1]  # 100 ms < 2 * 60 ms


def kv_view(iteration: int, free_blocks: int, queued_prompt: int):
    waiting = make_view(id=99, prompt_tokens=queued_prompt)
    return make_scheduler_view([waiting], iteration=iteration, free_blocks=free_blocks,
                               total_blocks=100, block_size=16, now=0.05 * iteration)


def test_kunserve_drops_after_two_overloaded_iterations_and_restores_below_40_percent():
    policy = load("kunserve")
    # (free blocks, queued prompt tokens) per iteration; 4 free blocks = 96% used, 64 tokens free
    calm = [(65, 10)]  # 35% used and 10 tokens queued: 35.6%, below 40%
    trace = ([(4, 100), (4, 100), (4, 100), (4, 10), (40, 10)] + calm * 79 + [(40, 10)]
             + calm * 81 + [(4, 100)])
    signals = [policy.decide(kv_view(i, free, queued)).overload
               for i, (free, queued) in enumerate(trace)]
    # iterations 50 ms apart: a lull of 79 (3.9 s) restores nothing; the 81st calm iteration
    # running, 4 s after the lull began, does (the hold: one iteration above 40% resets it)
    assert signals == [None, "drop", "drop"] + [None] * 162 + ["restore", None]
    n = len(trace)
    assert policy.decide(kv_view(n - 1, 4, 100)).overload is None  # same iteration: same answer
    assert policy.decide(kv_view(n, 4, 100)).overload == "drop"


# --------------------------------------------------------------------------- FastSwitch ladder

LADDER = {"markov": ["vllm_baseline", "groups", "reuse", "fastswitch"],
          "random": ["vllm_baseline", "groups", "reuse", "fastswitch"]}


def rerank_run(policy, iterations: int = 60) -> list[list[int]]:
    """Orders over `iterations` iterations of 12 requests, the first 4 of them running."""
    requests = [make_view(id=i, arrival=float(i), state="running" if i <= 4 else "waiting")
                for i in range(1, 13)]
    out = []
    for it in range(iterations):
        d = policy.decide(make_scheduler_view(requests, iteration=it))
        out.append(ids(d))
        states = {r.id: "running" if rank < 4 else "waiting" for rank, r in enumerate(d.order)}
        requests = [r._replace(state=states.get(r.id, r.state)) for r in requests]  # top 4 run
    return out


@pytest.mark.parametrize("pattern", ["markov", "random"])
def test_the_ablation_ladder_changes_memory_settings_only(pattern):
    names = [f"{step}_{pattern}" for step in LADDER[pattern]]
    policies = [load(n) for n in names]
    assert len({tuple(rerank_run(p)[-1]) for p in policies}) == 1  # same decisions
    memories = [(p.settings.memory.swap_granularity, p.settings.memory.kv_reuse,
                 p.settings.memory.swap_in) for p in policies]
    assert memories == [("per-block", False, "sync"), ("groups", False, "sync"),
                        ("groups", True, "sync"), ("groups", True, "adaptive")]
    assert {(p.settings.preempt_mode, p.parts["rerank"].every_iterations) for p in policies} == \
        {("swap", 25)}
    assert all(load(n).decide(make_scheduler_view([make_view()])).displace for n in names)


@pytest.mark.parametrize("pattern", ["markov", "random"])
def test_priorities_hold_between_reranks_every_25_iterations(pattern):
    orders = rerank_run(load(f"fastswitch_{pattern}"), iterations=75)
    for start in (0, 25, 50):
        assert all(o == orders[start] for o in orders[start:start + 25])
    assert orders[0] != orders[25] or orders[25] != orders[50]


def test_markov_keeps_the_served_on_top_more_often_than_random():
    def stays(pattern: str) -> float:
        orders = rerank_run(load(f"fastswitch_{pattern}"), iterations=25 * 40)[::25]
        kept = [len(set(a[:4]) & set(b[:4])) / 4 for a, b in zip(orders, orders[1:])]
        return sum(kept) / len(kept)

    markov, random = stays("markov"), stays("random")
    assert markov > 0.7 and random < 0.5, (markov, random)


def test_a_seeded_rerank_is_reproducible():
    assert rerank_run(load("fastswitch_random"), 30) == rerank_run(load("vllm_baseline_random"), 30)
    assert rerank_run(load("fastswitch_markov"), 30) != rerank_run(load("fastswitch_random"), 30)


def test_new_arrivals_get_a_priority_on_arrival():
    policy = load("fastswitch_random")
    first = [make_view(id=1), make_view(id=2)]
    policy.decide(make_scheduler_view(first, iteration=0))
    later = first + [make_view(id=3)]
    d = policy.decide(make_scheduler_view(later, iteration=1))
    values = policy.parts["rerank"].values
    assert set(values) == {1, 2, 3} and all(0.0 <= v < 1.0 for v in values.values())
    assert ids(d) == sorted((1, 2, 3), key=lambda i: -values[i])
    assert not math.isnan(sum(values.values()))


def test_bros_no_bicache_is_bros_without_the_bidirectional_cache():
    """The ablation schedules as bros does, rule for rule: only the name, the memory setting
    and the preemption differ (bros swaps its victims into its table's copy space; the ablation
    recomputes, and a running request short of a block is itself recomputed, BROS §7.4.1; so a
    change to bros's rules must be made to both)."""
    def body(name: str) -> str:
        text = policy_path(name).read_text()
        return text[text.index("policy "):].replace(name, "P", 1)

    assert body("bros").replace("  memory { bidirectional on }\n", "").replace(
        "preempt swap displace", "preempt recompute displace short_of_block = self"
    ) == body("bros_no_bicache")
    bros, ablation = load("bros").settings, load("bros_no_bicache").settings
    assert bros.memory.bidirectional and not ablation.memory.bidirectional
    assert bros.preempt_mode == "swap" and ablation.preempt_mode == "recompute"
    assert bros.short_of_block == "below" and ablation.short_of_block == "self"
    assert attrs.evolve(ablation, name="bros", memory=bros.memory, preempt_mode="swap",
                        short_of_block="below") == bros


def test_bros_counts_bringing_kv_back_from_the_host_in_the_iteration_time():
    from engine.cost_model import CopyCost

    # 1 MB blocks over 1 GB/s: 1 ms a block, overlapping the model (max, BROS §4.1)
    cost = attrs.evolve(COST, copy=CopyCost(bandwidth_gb_per_s=1.0, dispatch_us=0.0),
                        block_bytes=10**6)
    requests = [decode(1, request_class="rt", slack_ms=40.0, checkpointed_blocks=50),
                decode(2, request_class="rt", slack_ms=60.0)]
    assert batch_ids(load("bros").decide(make_scheduler_view(requests, cost=COST))) == [1, 2]
    # 50 ms of copies for request 1 are more than its 40 ms: it can no longer make it
    assert batch_ids(load("bros").decide(make_scheduler_view(requests, cost=cost))) == [2, 1]
