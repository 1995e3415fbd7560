"""`memory { bidirectional on }` with block groups is refused at the setting: the bidirectional
table places and copies KV slot by slot, so groups would silently have no effect."""

from __future__ import annotations

import pytest

from policies import policy_dir
from policy_lang import compile_policy
from shunter import PolicyCheckError


def test_block_groups_with_bidirectional_blocks_are_refused_at_the_setting():
    text = "policy p {\n  memory { bidirectional on; swap_granularity groups }\n}\n"
    with pytest.raises(PolicyCheckError) as info:
        compile_policy(text, filename="t.policy")
    assert str(info.value) == (
        "t.policy:2:47: swap_granularity groups needs bidirectional off: bidirectional blocks "
        "are placed and copied slot by slot, one block per table entry, so block groups would "
        "have no effect\n"
        "    memory { bidirectional on; swap_granularity groups }\n"
        "                                                ^~~~~~")


@pytest.mark.parametrize("setting, why", [
    ("kv_reuse on", "the bidirectional table's host space holds checkpoints and swapped requests "
                    "only, so no KV copy would be kept across turns"),
    ("prefix_cache on", "a bidirectional block holds two requests' KV, one from each end, so it "
                        "is no one prefix's block to share")])
def test_what_bros_table_cannot_honour_is_refused_at_the_setting(setting, why):
    """The engine with BROS's table keeps no host copies across turns (kv_reuse was silently
    ignored before round 9) and shares no prefix blocks."""
    text = f'policy p extends "bros.policy" {{\n  memory {{ {setting} }}\n}}\n'
    with pytest.raises(PolicyCheckError) as info:
        compile_policy(text, filename="t.policy", base_dir=policy_dir())
    name, on = setting.split()
    assert str(info.value) == (f"t.policy:2:{13 + len(name)}: {name} on needs bidirectional off: "
                               f"{why}\n    memory {{ {setting} }}\n{' ' * (14 + len(name))}^~")


@pytest.mark.parametrize("memory", ["bidirectional on; swap_granularity per-block",
                                    "bidirectional on; kv_reuse off",
                                    "bidirectional off; swap_granularity groups"])
def test_either_alone_is_accepted(memory):
    compile_policy(f"policy p {{\n  memory {{ {memory} }}\n}}\n", filename="t.policy")
