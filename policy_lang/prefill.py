"""The `prefill` statement: how an iteration mixes prompts and decodes, and its token budget.

    prefill mixed                             # the default: prompts chunked beside decodes
    prefill separate(budget = 2048 tokens)    # vLLM V0 without chunked prefill
    prefill separate(budget = 2048 tokens, watermark = 1%)   # and V0's admission watermark

`separate` is vLLM V0's default scheduler (vllm-project/vllm vllm/core/scheduler.py
`Scheduler._schedule_default`): an iteration takes whole waiting prompts and nothing else, and
decodes run only in an iteration that took no prompt (engine/planner.py `separate_phases`).
`budget` replaces the engine's max_batched_tokens for this policy; vLLM V0's default without
chunked prefill is max(max_model_len, 2048) (vllm/config.py `SchedulerConfig`). `watermark`: the
share of all blocks a prompt must leave free to be admitted (V0's `BlockSpaceManagerV1`, 0.01
by default; 0 here unless written). Checked here,
with check.py's `check` (policy_lang/api.py); read by compile.py and explain.py.
"""

from __future__ import annotations

from policy_lang import ast
from policy_lang.check import Checker, read_args
from policy_lang.diagnostics import Diagnostic, did_you_mean, one_of
from policy_lang.loader import RuleSet
from policy_lang.settings import Param

MODES = ("mixed", "separate")
ARGS = {"budget": Param(kind="tokens", minimum=1), "watermark": Param(kind="share", default=0.0)}


def check_prefill(rules: RuleSet) -> list[Diagnostic]:
    """The `prefill` statement's diagnostics (beside check.py's `check`)."""
    checker = Checker(rules)
    p = rules.get("prefill")
    if not isinstance(p, ast.Prefill):
        return []
    if p.mode.name not in MODES:
        checker.error(p.mode, f"prefill must be one of {one_of(MODES)}, got '{p.mode.name}'"
                              f"{did_you_mean(p.mode.name, MODES)}")
    checker.args(p, p.args, ARGS, f"prefill {p.mode.name}")
    if p.mode.name != "separate" and any(a.name and a.name.name == "watermark" for a in p.args):
        checker.error(p, "watermark is kept when whole prompts are admitted: use it with "
                         "prefill separate")
    if p.mode.name == "separate" and rules.get("pack") is not None:
        checker.error(p, "prefill separate cannot be used with pack: pack builds each batch "
                         "itself, prompt chunks beside decodes (BROS §6); remove one of them")
    return checker.diags


def read_prefill(rules: RuleSet) -> tuple[str, int | None, float]:
    """(mode, token budget or None for the engine's, watermark) of a checked policy."""
    p = rules.get("prefill")
    if not isinstance(p, ast.Prefill):
        return "mixed", None, 0.0
    a = read_args(p.args, ARGS)
    return p.mode.name, a["budget"], a["watermark"]


def explain_prefill(rules: RuleSet) -> str:
    mode, budget, watermark = read_prefill(rules)
    tokens = f"{budget} tokens" if budget is not None else "the engine's token budget"
    if mode == "separate":
        keep = f", each leaving {watermark:.0%} of the blocks free" if watermark else ""
        return (f"Prompts and decodes (vLLM V0): an iteration takes whole waiting prompts in "
                f"order, up to {tokens}{keep}, and no decodes; decodes run when no prompt was "
                "taken.")
    if rules.get("prefill") is None:
        return ""
    return f"Prompts and decodes: prompts are chunked into {tokens} beside decodes."
