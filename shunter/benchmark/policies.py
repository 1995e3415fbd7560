"""What `shunter bench --policy` names: a policy file, or a shipped policy by name, optionally
with engine settings for that run: `fcfs@max_num_seqs=16,max_batched_tokens=1024`."""

from __future__ import annotations

from pathlib import Path

import attrs

from engine.errors import PolicyError
from engine.policy import FcfsPolicy, Policy

POLICY_DIR = Path(__file__).resolve().parents[2] / "policies"

ENGINE_KEYS = ("max_num_seqs", "max_batched_tokens", "num_blocks", "max_queued_requests",
               "block_size", "cpu_swap_blocks")
"""Engine settings a run may override after `@`."""


@attrs.frozen(kw_only=True)
class PolicyChoice:
    label: str
    """How the run is named in the table and the JSON (the argument as given)."""
    path: Path | None
    """The policy file, or None for the built-in FCFS."""
    overrides: dict[str, int] = attrs.field(factory=dict)

    def policy(self) -> Policy | None:
        """The policy object to start the engine with, or None to let the engine load
        `path` itself (checked against the mechanisms it has: a policy needing swap is refused
        with a PolicyError naming the setting)."""
        return FcfsPolicy() if self.path is None else None


def parse_policy(arg: str) -> PolicyChoice:
    """`NAME_OR_FILE[@key=value,...]`. A name finds `policies/NAME.policy`; `fcfs` falls back to
    the built-in FCFS policy while the policy language is absent."""
    target, _, rest = arg.partition("@")
    overrides: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in ENGINE_KEYS:
            raise PolicyError(f"--policy {arg!r}: {item!r} is not key=value with a key among "
                              f"{', '.join(ENGINE_KEYS)}")
        try:
            overrides[key] = int(value)
        except ValueError:
            raise PolicyError(f"--policy {arg!r}: {key}={value!r} is not an integer") from None
    if target.endswith(".policy"):
        path = Path(target)
    else:
        path = POLICY_DIR / f"{target}.policy"
        if target == "fcfs" and not (path.is_file() and _has_policy_language()):
            return PolicyChoice(label=arg, path=None, overrides=overrides)
    if not path.is_file():
        raise PolicyError(f"--policy {arg!r}: no file {path}")
    if not _has_policy_language():
        raise PolicyError(f"--policy {arg!r}: policy files need the policy language "
                          "(policy_lang.load_policy_file), which this build lacks")
    return PolicyChoice(label=arg, path=path, overrides=overrides)


def _has_policy_language() -> bool:
    try:
        from policy_lang import load_policy_file  # type: ignore[attr-defined]  # noqa: F401
    except ImportError:
        return False
    return True
