"""The Shunter policy language: grammar.lark -> parser -> ast -> check -> compile -> runtime.

    policy = load_policy_file("policies/bros.policy")
    decision = policy.decide(view)

Importing the package (or `policy_lang.runtime`) does not import Lark; the compiler is loaded
on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompiledPolicy", "compile_policy", "load_policy_file"]


def __getattr__(name: str) -> Any:
    if name in ("compile_policy", "load_policy_file"):
        from policy_lang import api

        return getattr(api, name)
    if name == "CompiledPolicy":
        from policy_lang.runtime import CompiledPolicy

        return CompiledPolicy
    raise AttributeError(f"module 'policy_lang' has no attribute {name!r}")
