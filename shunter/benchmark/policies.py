"""What `shunter bench --policy` names: a policy file, or a shipped policy by name, optionally
with engine settings for that run: `fcfs@max_num_seqs=16,max_batched_tokens=1024`."""

from __future__ import annotations

from pathlib import Path

import attrs

from engine.errors import PolicyError
from policies import find_policy

ENGINE_KEYS = ("max_num_seqs", "max_batched_tokens", "num_blocks", "max_queued_requests",
               "block_size", "cpu_swap_blocks")
"""Engine settings a run may override after `@`."""


@attrs.frozen(kw_only=True)
class PolicyChoice:
    label: str
    """How the run is named in the table and the JSON (the argument as given)."""
    path: Path
    """The policy file. The engine loads it, checked against the mechanisms it has: a policy
    needing swap is refused with a PolicyError naming the setting."""
    overrides: dict[str, int] = attrs.field(factory=dict)


def parse_policy(arg: str) -> PolicyChoice:
    """`NAME_OR_FILE[@key=value,...]`. A name finds the shipped `policies/NAME.policy`."""
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
    return PolicyChoice(label=arg, path=find_policy(target, "--policy"), overrides=overrides)
