"""`memory { bidirectional on }` with block groups is refused at the setting: the bidirectional
table places and copies KV slot by slot, so groups would silently have no effect."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("memory", ["bidirectional on; swap_granularity per-block",
                                    "bidirectional off; swap_granularity groups"])
def test_either_alone_is_accepted(memory):
    compile_policy(f"policy p {{\n  memory {{ {memory} }}\n}}\n", filename="t.policy")
