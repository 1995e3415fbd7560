"""Malformed policies: each case asserts the exact error text, line and column included."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies import policy_dir
from policy_lang import compile_policy
from shunter import PolicyCheckError, PolicySyntaxError

SYNTAX = {
    "wrong token": (
        "policy p {\n  priority = arrival asc\n  preempt = swap\n}\n",
        "t.policy:3:11: unexpected '='; expected a name\n"
        "    preempt = swap\n"
        "            ^"),
    "unclosed block before the next statement": (
        "policy p {\n  class rt { ttft 400ms\n  preempt swap\n}\n",
        "t.policy:3:3: unexpected 'preempt'; expected ';', '}', a name (is a '}' missing before it?)\n"
        "    preempt swap\n"
        "    ^~~~~~~"),
    "short_of_block without '='": (
        "policy p {\n  preempt recompute short_of_block self\n}\n",
        "t.policy:2:36: unexpected name 'self'; expected '='\n"
        "    preempt recompute short_of_block self\n"
        "                                     ^~~~"),
    "unclosed block at the end of the file": (
        "policy p {\n  priority rt =",
        "t.policy:1:10: this '{' is never closed (the file ends first)\n"
        "  policy p {\n"
        "           ^"),
    "unexpected character": (
        "policy p {\n  priority = slack $ 2\n}\n",
        "t.policy:2:20: unexpected character '$'\n"
        "    priority = slack $ 2\n"
        "                     ^"),
    "misspelled keyword": (
        "policy p {\n  prioritty = arrival asc\n}\n",
        "t.policy:2:3: unexpected 'prioritty'; did you mean 'priority'?\n"
        "    prioritty = arrival asc\n"
        "    ^~~~~~~~~"),
    "misspelled direction": (
        "policy p {\n  priority = arrival ascending\n}\n",
        "t.policy:2:22: unexpected 'ascending'; did you mean 'asc'?\n"
        "    priority = arrival ascending\n"
        "                       ^~~~~~~~~"),
    "missing expression": (
        "policy p {\n  priority =\n}\n",
        "t.policy:3:1: unexpected '}'; expected '(', '-', 'class', 'not', a \"string\", a name, "
        "a number\n"
        "  }\n"
        "  ^"),
}

CHECK = {
    "unknown field": (
        "policy p {\n  priority = slak asc\n}\n",
        "t.policy:2:14: unknown field 'slak'; did you mean 'slack'?\n"
        "    priority = slak asc\n"
        "               ^~~~"),
    "field of the wrong scope": (
        "policy p {\n  priority = kv_usage desc\n}\n",
        "t.policy:2:14: 'kv_usage' is one of the engine statistics; a priority key can read "
        "request fields only\n"
        "    priority = kv_usage desc\n"
        "               ^~~~~~~~"),
    "duration without a unit": (
        "policy p {\n  class rt { ttft 400; tpot 200ms }\n}\n",
        "t.policy:2:19: ttft needs a duration (ms or s), got a plain number; write 400ms\n"
        "    class rt { ttft 400; tpot 200ms }\n"
        "                    ^~~"),
    "tokens where ms are expected": (
        "policy p {\n  class rt { ttft 400 tokens }\n}\n",
        "t.policy:2:19: ttft needs a duration (ms or s), got tokens\n"
        "    class rt { ttft 400 tokens }\n"
        "                    ^~~~~~~~~~"),
    "fraction compared with a plain number": (
        "policy p {\n  overload drop when kv_usage > 0.95\n}\n",
        "t.policy:2:22: cannot compare a percentage with a plain number; write 95%\n"
        "    overload drop when kv_usage > 0.95\n"
        "                       ^~~~~~~~~~~~~~~"),
    "tokens added to a duration": (
        "policy p {\n  include \"rtbe_classes.policy\"\n  priority rt = slack asc\n"
        "  pack { rt while est_iteration + 5 tokens < min_slack; be fill }\n}\n",
        "t.policy:4:19: cannot add tokens to a duration\n"
        "    pack { rt while est_iteration + 5 tokens < min_slack; be fill }\n"
        "                    ^~~~~~~~~~~~~~~~~~~~~~~~"),
    "a condition that is not one": (
        "policy p {\n  overload drop when free_blocks\n}\n",
        "t.policy:2:22: an overload condition must be a condition (a comparison), got blocks\n"
        "    overload drop when free_blocks\n"
        "                       ^~~~~~~~~~~"),
    "missing include": (
        "policy p {\n  include \"nowhere.policy\"\n}\n",
        "t.policy:2:11: cannot include \"nowhere.policy\": No such file or directory "
        "({dir}/nowhere.policy)\n"
        "    include \"nowhere.policy\"\n"
        "            ^~~~~~~~~~~~~~~~"),
    "missing base": (
        "policy p extends \"base.policy\" {\n}\n",
        "t.policy:1:18: cannot extend \"base.policy\": No such file or directory "
        "({dir}/base.policy)\n"
        "  policy p extends \"base.policy\" {\n"
        "                   ^~~~~~~~~~~~~"),
    "extending a fragment": (
        "policy p extends \"rtbe_classes.policy\" {\n}\n",
        "t.policy:1:18: cannot extend \"rtbe_classes.policy\": it is a fragment, not a policy "
        "(include it instead)\n"
        "  policy p extends \"rtbe_classes.policy\" {\n"
        "                   ^~~~~~~~~~~~~~~~~~~~~"),
    "unknown class": (
        "policy p {\n  include \"rtbe_classes.policy\"\n  precedence rt > eb\n}\n",
        "t.policy:3:19: unknown class 'eb' (classes: rt, be)\n"
        "    precedence rt > eb\n"
        "                    ^~"),
    "rule set twice": (
        "policy p {\n  preempt swap\n  preempt recompute\n}\n",
        "t.policy:3:3: preempt is already set at line 2\n"
        "    preempt recompute\n"
        "    ^~~~~~~~~~~~~~~~~"),
    "rerank nobody orders by": (
        "policy p {\n  every 25 iterations: rerank markov(stay = 0.8, seed = 7)\n}\n",
        "t.policy:2:3: the rerank has no effect: no priority rule orders by assigned_priority\n"
        "    every 25 iterations: rerank markov(stay = 0.8, seed = 7)\n"
        "    ^~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~"),
    "assigned priority without a rerank": (
        "policy p {\n  priority = assigned_priority desc\n}\n",
        "t.policy:2:14: assigned_priority is set by a rerank; add one, e.g. `every 25 iterations: "
        "rerank markov(stay = 0.8, seed = 7)`\n"
        "    priority = assigned_priority desc\n"
        "               ^~~~~~~~~~~~~~~~~"),
    "bad rerank arguments": (
        "policy p {\n  every 25 iterations: rerank markov(stay = 1.5, sed = 2)\n"
        "  priority = assigned_priority desc\n}\n",
        "t.policy:2:45: stay must be between 0 and 1 (or 0% and 100%), got 1.5\n"
        "    every 25 iterations: rerank markov(stay = 1.5, sed = 2)\n"
        "                                              ^~~\n"
        "t.policy:2:50: unknown argument 'sed' of markov(); did you mean 'seed'? (arguments: stay, "
        "seed)\n"
        "    every 25 iterations: rerank markov(stay = 1.5, sed = 2)\n"
        "                                                   ^~~"),
    "bad memory settings": (
        "policy p {\n  memory { swap_granularity group; swap_inn sync }\n}\n",
        "t.policy:2:29: swap_granularity must be one of per-block, groups, got 'group'; did you "
        "mean 'groups'?\n"
        "    memory { swap_granularity group; swap_inn sync }\n"
        "                              ^~~~~\n"
        "t.policy:2:36: unknown memory setting 'swap_inn'; did you mean 'swap_in'? (settings: "
        "bidirectional, kv_exchange, kv_reuse, microbatch, prefix_cache, restore_from, "
        "restore_prefetch, swap_granularity, swap_in, turn_copies)\n"
        "    memory { swap_granularity group; swap_inn sync }\n"
        "                                     ^~~~~~~~"),
    "classes without a precedence": (
        "policy p {\n  include \"rtbe_classes.policy\"\n  priority rt = slack asc\n}\n",
        "t.policy:3:3: classes have their own priority rules, so say how classes compare: add e.g. "
        "`precedence rt > be` or a pack block\n"
        "    priority rt = slack asc\n"
        "    ^~~~~~~~~~~~~~~~~~~~~~~"),
    "unknown short_of_block": (
        "policy p {\n  preempt recompute displace short_of_block = slef\n}\n",
        "t.policy:2:47: unknown short_of_block 'slef'; did you mean 'self'? (who is preempted "
        "when a running request lacks a block: below, self)\n"
        "    preempt recompute displace short_of_block = slef\n"
        "                                                ^~~~"),
    "short_of_block = self without preemption": (
        "policy p {\n  preempt never short_of_block = self\n}\n",
        "t.policy:2:34: preempt never cannot preempt a request short of a block itself\n"
        "    preempt never short_of_block = self\n"
        "                                   ^~~~"),
    "unknown class in a comparison": (
        "policy p {\n  include \"rtbe_classes.policy\"\n  priority = class == \"tr\" desc\n}\n",
        "t.policy:3:23: unknown class \"tr\" (known: be, rt)\n"
        "    priority = class == \"tr\" desc\n"
        "                        ^~~~"),
}


def compile_text(text: str, base: Path | None = None) -> None:
    compile_policy(text, filename="t.policy", base_dir=base or policy_dir())


@pytest.mark.parametrize("case", SYNTAX, ids=list(SYNTAX))
def test_syntax_errors_point_at_the_offending_token(case):
    text, want = SYNTAX[case]
    with pytest.raises(PolicySyntaxError) as info:
        compile_text(text)
    assert str(info.value) == want
    assert info.value.diagnostics[0].span.file == "t.policy"


@pytest.mark.parametrize("case", CHECK, ids=list(CHECK))
def test_check_errors_name_the_problem_and_its_place(case):
    text, want = CHECK[case]
    with pytest.raises(PolicyCheckError) as info:
        compile_text(text)
    assert str(info.value) == want.replace("{dir}", str(policy_dir()))


def test_an_include_cycle_is_reported_where_it_closes(tmp_path):
    (tmp_path / "a.policy").write_text('include "b.policy"\n')
    (tmp_path / "b.policy").write_text('class x { }\ninclude "a.policy"\n')
    with pytest.raises(PolicyCheckError) as info:
        compile_text('policy p {\n  include "a.policy"\n}\n', tmp_path)
    assert str(info.value) == (
        f"{tmp_path}/b.policy:2:9: include cycle: a.policy -> b.policy -> a.policy\n"
        '  include "a.policy"\n'
        "          ^~~~~~~~~~")


def test_a_syntax_error_in_an_included_file_names_that_file(tmp_path):
    (tmp_path / "part.policy").write_text("class rt { ttft 400ms\n")
    with pytest.raises(PolicySyntaxError) as info:
        compile_text('policy p {\n  include "part.policy"\n}\n', tmp_path)
    assert str(info.value) == (
        f"{tmp_path}/part.policy:1:10: this '{{' is never closed (the file ends first)\n"
        "  class rt { ttft 400ms\n"
        "           ^")


def test_a_self_extending_policy_is_a_cycle(tmp_path):
    path = tmp_path / "me.policy"
    path.write_text('policy me extends "me.policy" { }\n')
    from policy_lang import load_policy_file

    with pytest.raises(PolicyCheckError, match=r"me.policy:1:19: extends cycle: me.policy -> me.policy"):
        load_policy_file(path)
