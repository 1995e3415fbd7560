"""The `prefill` statement (policy_lang/prefill.py): parsed, checked with file:line:col,
compiled into the settings the planner reads, explained."""

from __future__ import annotations

import pytest

from engine.cost_model import CostModel
from policies import policy_dir, policy_path
from policy_lang import compile_policy, load_policy_file
from shunter import PolicyCheckError
from tests.factories import make_scheduler_view, make_view

PACKED = ("policy p {\n  class rt { ttft 400ms }\n  class be { }\n  default class be\n"
          "  pack { rt while est_iteration < min_slack; be fill }\n  prefill separate\n}\n")


@pytest.mark.parametrize(("text", "mode", "budget"), [
    ("policy p { }", "mixed", None),
    ("policy p { prefill separate }", "separate", None),
    ("policy p { prefill separate(budget = 2048 tokens) }", "separate", 2048),
    ("policy p { prefill mixed(1024 tokens) }", "mixed", 1024),
])
def test_settings(text: str, mode: str, budget: int | None) -> None:
    s = compile_policy(text).settings
    assert (s.prefill, s.token_budget, s.prompt_watermark) == (mode, budget, 0.0)


def test_watermark() -> None:
    s = compile_policy("policy p { prefill separate(watermark = 1%) }").settings
    assert (s.prefill, s.token_budget, s.prompt_watermark) == ("separate", None, 0.01)


@pytest.mark.parametrize(("text", "error"), [
    ("policy p {\n  prefill seperate\n}\n",
     ("t.policy:2:11: prefill must be one of mixed, separate, got 'seperate'; did you mean "
     "'separate'?")),
    ("policy p {\n  prefill separate(budget = 2048)\n}\n",
     "t.policy:2:29: budget needs tokens (tokens), got a plain number; write 2048 tokens"),
    ("policy p {\n  prefill separate(budget = 0 tokens)\n}\n",
     "t.policy:2:29: budget must be a whole number >= 1, got 0"),
    ("policy p {\n  prefill separate(budgte = 8 tokens)\n}\n",
     ("t.policy:2:20: unknown argument 'budgte' of prefill separate; did you mean 'budget'? "
     "(arguments: budget, watermark)")),
    ("policy p {\n  prefill mixed(watermark = 1%)\n}\n",
     ("t.policy:2:3: watermark is kept when whole prompts are admitted: use it with prefill "
     "separate")),
    ("policy p {\n  prefill separate(watermark = 2)\n}\n",
     "t.policy:2:32: watermark must be between 0 and 1 (or 0% and 100%), got 2"),
    (PACKED, ("t.policy:6:3: prefill separate cannot be used with pack: pack builds each batch "
             "itself, prompt chunks beside decodes (BROS §6); remove one of them")),
])
def test_errors_point_at_the_setting(text: str, error: str) -> None:
    with pytest.raises(PolicyCheckError) as e:
        compile_policy(text, filename="t.policy")
    assert str(e.value).splitlines()[0] == error


def test_the_shipped_vllm_v0_policy() -> None:
    p = load_policy_file(policy_path("vllm_v0"))
    s = p.settings
    assert (s.prefill, s.token_budget, s.prompt_watermark, s.preempt_mode) == (
        "separate", 2048, 0.01, "recompute")
    assert ("an iteration takes whole waiting prompts in order, up to 2048 tokens, each leaving "
            "1% of the blocks free, and no decodes" in p.explain())


def test_packing_reads_the_policys_budget() -> None:
    """bros with `prefill mixed(budget = 2048 tokens)` on an engine of 512: a 1,500-token RT
    prompt with 170 ms of slack needs 3 chunks of 61 ms at 512 tokens (late, so it goes after a
    request that can make it) but one of 160 ms at 2,048 (it leads, by slack, and the other no
    longer fits its deadline beside it)."""
    cost = CostModel(a_ms=10.0, b_ms_per_prefill_token=0.1, c_ms_per_prefill_token_sq=0.0,
                     d_ms_per_decode_seq=1.0, e_ms_per_decode_context_token=0.0)
    requests = [make_view(id=1, state="waiting", prompt_tokens=1500, request_class="rt",
                          slack_ms=170.0),
                make_view(id=2, state="waiting", prompt_tokens=100, request_class="rt",
                          slack_ms=300.0)]
    view = make_scheduler_view(requests, cost=cost, max_batched_tokens=512)
    orders = []
    for extra in ("", "prefill mixed(budget = 2048 tokens)"):
        p = compile_policy(f'policy b extends "bros.policy" {{ {extra} }}', base_dir=policy_dir())
        orders.append([r.id for r in p.decide(view).order])
    assert orders == [[2, 1], [1]]
