"""The compiler: orders equal their hand-written twins, expressions mean what their units say,
extends/include override the way the loader promises, and the runtime needs no Lark."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.policy import EngineCapabilities, FcfsPolicy
from policies import policy_dir
from policy_lang import compile_policy
from shunter import PolicyCheckError
from tests.factories import NOW, make_scheduler_view, make_view


def compile_text(text: str, **kw):
    return compile_policy(text, base_dir=policy_dir(), **kw)


def ids(decision) -> list[int]:
    return [r.id for r in decision.order]


requests_strategy = st.lists(
    st.builds(
        dict,
        arrival=st.integers(0, 20).map(float),
        priority=st.integers(0, 3),
        slack_ms=st.one_of(st.just(math.inf), st.integers(-50, 500).map(float)),
        checkpointed_blocks=st.integers(0, 4),
        request_class=st.sampled_from(["rt", "be", "other"]),
        tenant=st.sampled_from(["a", "b"]),
        state=st.sampled_from(["waiting", "running"]),
    ),
    max_size=30)


def build(requests: list[dict]):
    return [make_view(id=i + 1, **r) for i, r in enumerate(requests)]


@settings(max_examples=60, deadline=None)
@given(requests_strategy)
def test_compiled_fcfs_orders_as_the_hand_written_one(requests):
    view = make_scheduler_view(build(requests))
    compiled = compile_text('policy f extends "fcfs.policy" { }')
    assert ids(compiled.decide(view)) == ids(FcfsPolicy().decide(view))


PRECEDENCE = """
policy p {
  include "rtbe_classes.policy"
  precedence rt > be
  priority rt = slack asc, client_priority desc
  priority be = checkpointed_blocks asc, arrival desc
}
"""


@settings(max_examples=60, deadline=None)
@given(requests_strategy)
def test_class_precedence_orders_as_a_hand_written_sort(requests):
    views = build(requests)
    d = compile_text(PRECEDENCE).decide(make_scheduler_view(views))
    rt = [v for v in views if v.request_class == "rt"]
    be = [v for v in views if v.request_class != "rt"]  # unknown classes join the default, be
    want = sorted(rt, key=lambda v: (v.slack_ms(NOW), -v.priority, v.id)) + \
        sorted(be, key=lambda v: (v.checkpointed_blocks, -v.arrival, v.id))
    assert ids(d) == [v.id for v in want]


@pytest.mark.parametrize(("key", "expect"), [
    ("waited > 2s", [2, 1]),                  # waited_s 3 vs 1: 3000 ms > 2000 ms
    ("waited > 2000ms", [2, 1]),
    ("slack / 2 < 30ms", [1, 2]),             # 40/2 = 20 < 30; 100/2 = 50
    ("min(slack, waited) <= 40ms", [1, 2]),
    ("age > 1s and not (state == \"running\")", [2, 1]),
    ("context_tokens + 5 tokens > 20 tokens or client_priority > 5", [2, 1]),
    ("-slack", [1, 2]),                      # -40 > -100
    ("abs(slack - 100ms)", [1, 2]),          # 60 > 0
    ("class == \"be\"", [2, 1]),
])
def test_expressions_mean_what_their_units_say(key, expect):
    policy = compile_text(f'policy e {{ include "rtbe_classes.policy"\n priority = {key} desc }}')
    r1 = make_view(id=1, request_class="rt", slack_ms=40.0, waited_s=1.0, arrival=99.5,
                   state="running", prompt_tokens=10)
    r2 = make_view(id=2, request_class="be", slack_ms=100.0, waited_s=3.0, arrival=50.0,
                   prompt_tokens=30)
    assert ids(policy.decide(make_scheduler_view([r1, r2], now=100.0))) == expect


def test_extends_replaces_rules_by_key_and_include_splices_in_place(tmp_path):
    (tmp_path / "base.policy").write_text(
        "policy base {\n  class rt { ttft 100ms }\n  class be { }\n  default class be\n"
        "  precedence rt > be\n  preempt swap\n  memory { swap_in async; kv_reuse on }\n}\n")
    (tmp_path / "slo.policy").write_text("class rt { ttft 400ms; tpot 50ms }\n")
    child = compile_policy(
        'policy child extends "base.policy" {\n  include "slo.policy"\n  preempt recompute\n'
        '  memory { kv_reuse off }\n}\n', base_dir=tmp_path)
    s = child.settings
    assert [(c.name, c.ttft_ms, c.tpot_ms) for c in s.classes] == \
        [("rt", 400.0, 50.0), ("be", None, None)]
    assert (s.name, s.default_class, s.preempt_mode) == ("child", "be", "recompute")
    assert (s.memory.swap_in, s.memory.kv_reuse) == ("async", False)


def test_a_rerank_without_a_schedule_keeps_the_inherited_one(tmp_path):
    (tmp_path / "m.policy").write_text(
        "policy m {\n  frequency 0.02: rerank markov(stay = 0.9, seed = 1)\n"
        "  priority = assigned_priority desc\n}\n")
    child = compile_policy('policy r extends "m.policy" { rerank random(seed = 3) }',
                           base_dir=tmp_path)
    rerank = child.parts["rerank"]
    assert (rerank.pattern, rerank.every_iterations) == ("random", 50)


def test_a_time_based_rerank_waits_for_the_clock():
    policy = compile_text("policy t {\n  every 2s: rerank random(seed = 1)\n"
                          "  priority = assigned_priority desc\n}\n")
    rerank = policy.parts["rerank"]
    views = [make_view(id=1), make_view(id=2)]
    for now, iteration in ((10.0, 0), (11.0, 5), (11.9, 9), (12.0, 10), (13.5, 11)):
        policy.decide(make_scheduler_view(views, now=now, iteration=iteration))
    assert rerank.reranks == 2  # at 10.0 and 12.0


def test_settings_carry_classes_limits_and_memory():
    p = compile_text('policy s {\n  class rt { ttft 0.4s; tpot 200ms; max_running 4; max_queued 9 }\n'
                     '  class be { }\n  default class be\n  precedence rt > be\n'
                     '  preempt never\n  batch max 16\n}\n')
    rt = p.settings.class_spec("rt")
    assert (rt.ttft_ms, rt.tpot_ms, rt.max_running, rt.max_queued) == (400.0, 200.0, 4, 9)
    assert p.settings.class_spec(None).name == "be"
    d = p.decide(make_scheduler_view([make_view()]))
    assert (p.settings.preempt_mode, d.max_batch, d.displace) == ("never", 16, False)


def test_a_policy_needing_a_mechanism_the_engine_lacks_is_refused_where_it_says_so():
    text = "policy s {\n  preempt swap displace\n  memory { kv_reuse on }\n}\n"
    compile_policy(text, filename="s.policy")  # the language is fine
    with pytest.raises(PolicyCheckError) as info:
        compile_policy(text, filename="s.policy", capabilities=EngineCapabilities())
    assert str(info.value) == (
        "s.policy:2:3: preempt swap is not supported by this engine (it supports: never, "
        "recompute; it has no swap space)\n"
        "    preempt swap displace\n"
        "    ^~~~~~~~~~~~~~~~~~~~~\n"
        "s.policy:3:12: kv_reuse on is not supported by this engine (it has no swap space)\n"
        "    memory { kv_reuse on }\n"
        "             ^~~~~~~~~~~")
    later = EngineCapabilities(preempt_modes=frozenset({"recompute", "swap", "never"}),
                               swap_granularities=frozenset({"per-block", "groups"}),
                               swap_in_modes=frozenset({"sync", "async", "adaptive"}),
                               kv_reuse=True)
    compile_policy(text, filename="s.policy", capabilities=later)


def test_the_runtime_does_not_import_lark():
    code = ("import sys, policy_lang.runtime, policy_lang.state, policy_lang.packing, policy_lang; "
            "print('lark' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_explain_says_what_the_rules_do():
    text = compile_text('policy k extends "kunserve.policy" { batch max 4 }').explain()
    assert "Order: all requests by arrival, earliest first." in text
    assert ("Overload (KunServe §4.1): ask to drop parameters when "
            "head_tokens + pending_tokens > free_tokens has held for 2 iterations.") in text
    assert "Restore them (KunServe §4.4) when kv_usage < 40% has held for 4s." in text
    assert "Batch size: at most 4 requests per iteration." in text
