"""Replacing one rule of a policy's text (the REPL's `edit`), and the `shunter policy` commands."""

from __future__ import annotations

import pytest

from engine.policy import EngineCapabilities
from policies import available, policy_path
from policy_lang import ast, load_policy_file
from policy_lang.diagnostics import Diagnostic, Span
from policy_lang.edit import edit_rule, replace_rule
from policy_lang.parser import parse
from shunter import PolicyCheckError, PolicySyntaxError
from shunter.cli import main

BASE = """\
# a comment that stays
policy p {
  priority = arrival asc   # and this one
  preempt recompute
  memory { swap_in sync; kv_reuse off }
  every 25 iterations: rerank markov(stay = 0.8, seed = 7)
}
"""


@pytest.mark.parametrize(("rule", "old", "new"), [
    ("priority = client_priority desc", "priority = arrival asc", "priority = client_priority desc"),
    ("preempt   never", "preempt recompute", "preempt never"),
    ("memory { kv_reuse on }", "memory { swap_in sync; kv_reuse off }",
     "memory { swap_in sync; kv_reuse on }"),
    ("rerank random(seed = 1)", "every 25 iterations: rerank markov(stay = 0.8, seed = 7)",
     "every 25 iterations: rerank random(seed = 1)"),
])
def test_a_rule_replaces_the_statement_that_sets_the_same_thing(rule, old, new):
    assert replace_rule(BASE, rule) == BASE.replace(old, new)


def test_a_rule_the_file_does_not_set_is_added_before_the_closing_brace():
    head, brace, tail = BASE.rpartition("}")
    assert replace_rule(BASE, "batch max 8") == head + "  batch max 8\n" + brace + tail
    assert replace_rule("policy q { }\n", "preempt never") == "policy q { preempt never }\n"
    assert replace_rule("class a { }\n", "class b { }") == "class a { }\nclass b { }\n"


def test_a_malformed_rule_is_a_syntax_error_in_the_edit():
    with pytest.raises(PolicySyntaxError) as info:
        replace_rule(BASE, "priority = arrival sideways")
    assert str(info.value) == ("<edit>:1:20: unexpected name 'sideways'; expected ',', ';', 'asc', "
                               "'desc', a statement, end of file\n"
                               "  priority = arrival sideways\n"
                               "                     ^~~~~~~~")
    with pytest.raises(PolicySyntaxError, match="expected one rule, got 2"):
        replace_rule(BASE, "preempt never; batch max 2")


def test_nodes_carry_the_span_of_their_text():
    tree = parse(BASE, "b.policy")
    rule = tree.body[0]
    assert isinstance(rule, ast.PriorityRule)
    s = rule.keys[0].expr.span
    assert (s.file, s.line, s.column, s.end_column) == ("b.policy", 3, 14, 21)
    assert BASE[rule.span.start:rule.span.end] == "priority = arrival asc"
    assert tree.close is not None and BASE[tree.close.start] == "}"


def test_policy_check_prints_ok_or_each_error_and_exits_0_or_2(tmp_path, capsys):
    good = policy_path("fcfs")
    bad = tmp_path / "bad.policy"
    bad.write_text("policy bad {\n  priority = arival asc\n  preempt swapp\n}\n")
    assert main(["policy", "check", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: ok\n"
    assert main(["policy", "check", str(bad), str(good), str(tmp_path / "none.policy")]) == 2
    assert capsys.readouterr().out == (
        f"{bad}:2:14: unknown field 'arival'; did you mean 'arrival'?\n"
        "    priority = arival asc\n"
        "               ^~~~~~\n"
        f"{bad}:3:11: unknown preemption mode 'swapp'; did you mean 'swap'? (modes: swap, "
        "recompute, never)\n"
        "    preempt swapp\n"
        "            ^~~~~\n"
        f"{good}: ok\n"
        f"{tmp_path}/none.policy: no such policy file or shipped policy; shipped: "
        f"{', '.join(available())}\n")


def test_policy_check_checks_the_language_not_the_engine(capsys):
    path = policy_path("fastswitch_markov")
    assert main(["policy", "check", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: ok\n"
    # the same file on an engine without swap is refused: `check` did not ask the engine
    with pytest.raises(PolicyCheckError) as info:
        load_policy_file(path, capabilities=EngineCapabilities())
    assert str(info.value).splitlines()[0] == (
        f"{policy_path('vllm_baseline_markov')}:9:3: preempt swap is not supported by this "
        "engine (it supports: never, recompute; it has no swap space)")


def test_policy_explain_prints_plain_words(capsys):
    assert main(["policy", "explain", str(policy_path("bros"))]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Policy bros ({policy_path('bros')}).\n  BROS hybrid scheduling")
    for line in (
        "  rt: first token within 400 ms, then a token every 200 ms.",
        "  be (the default for requests that name no class): no deadlines.",
        "  1. take rt requests (by slack, smallest first) while est_iteration < min_slack; the "
        "first that fails ends this step and counts as a predicted deadline violation.",
        "  2. fill with be requests (by checkpointed_blocks, smallest first, then by arrival, "
        "earliest first) while the batch has room and est_iteration < min_slack.",
        "Batch size (BROS §4.2, adaptive): starts at 8, grows by 8 after each calm iteration up "
        "to the engine's max_num_seqs, and goes back to 8 after a predicted deadline violation.",
        "  est_iteration is predicted by the engine's cost model (a profile, or one fitted in the "
        "engine from its own iterations); before the engine has one, by the moving average of "
        "observed iteration times (BROS Table 1).",
    ):
        assert line in out.splitlines(), line


def _check_error(edit, *spans):
    """A PolicyCheckError as the compiler raises it, at (line, column, end_column) of the edited
    text, each `bad` in the file `p.policy`."""
    diags = tuple(Diagnostic(span=Span(file="p.policy", line=line, column=col, end_line=line,
                                       end_column=end), message="bad") for line, col, end in spans)
    return PolicyCheckError("bad", diagnostics=diags)


def test_errors_in_an_edit_point_into_the_rule_as_typed():
    # typed with runs of spaces: the file gets them collapsed, the error the typed columns
    edit = edit_rule(BASE, "priority   =  slak asc", filename="p.policy")
    assert "  priority = slak asc   # and this one" in edit.source
    assert edit.point_at_rule(_check_error(edit, (3, 14, 18)), "p.policy") == (
        "<edit>:1:15: bad\n"
        "  priority   =  slak asc\n"
        "                ^~~~")


def test_a_rule_of_several_lines_keeps_its_lines_and_errors_name_them():
    edit = edit_rule(BASE, "priority =\n    arrival asc,\n    slak desc\n", filename="p.policy")
    assert "  priority =\n    arrival asc,\n    slak desc   # and this one" in edit.source
    assert edit.point_at_rule(_check_error(edit, (5, 5, 9)), "p.policy") == (
        "<edit>:3:5: bad\n"
        "      slak desc\n"
        "      ^~~~")


def test_an_error_outside_the_rule_names_the_edited_text_not_the_file():
    edit = edit_rule(BASE, "preempt never", filename="p.policy")
    assert edit.point_at_rule(_check_error(edit, (4, 3, 10)), "p.policy") == (
        "<edit>:1:1: bad\n"
        "  preempt never\n"
        "  ^~~~~~~")
    assert edit.point_at_rule(_check_error(edit, (5, 3, 9)), "p.policy") == (
        "<p.policy as edited>:5:3: bad\n"
        "    memory { swap_in sync; kv_reuse off }\n"
        "    ^~~~~~")
