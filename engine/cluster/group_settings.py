"""KunServe's pipeline-group settings in a policy's `memory { }` block: their values (the
checker's, policy_lang/check.py) and which of them an engine's runner honours (its
`GROUP_MODES`, engine/policy.py `EngineCapabilities.group_modes`).

`kv_exchange` and `microbatch` (§4.2-4.3): a runner names each value it runs. The restore's
(§4.4): `restore_prefetch on` (the dropped weights and full KV blocks come back while the group
serves) and `restore_from peer` (from the members keeping them) are what every runner that runs
groups does; a runner that also restores at one step, or from each member's host copy, names
`restore_prefetch off` / `restore_from host` (the torch runner does, gpu/kunserve_runner.py, and
so does the simulator's, shunter/cluster/sim_restore.py: at one step, the group stalled for the
copies, and the weights over the host link); a runner that runs groups but names neither is
held to the defaults.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

GROUP_SETTINGS = {"kv_exchange": ("fifo", "coordinated"), "microbatch": ("tokens", "lookahead"),
                  "restore_prefetch": ("on", "off"), "restore_from": ("peer", "host")}
"""Each setting's values, its default first where the policy language has one."""


class GroupMemory(Protocol):
    """The group settings of a policy's `memory { }` (engine/policy.py `MemorySettings`)."""

    kv_exchange: str
    microbatch: str
    restore_prefetch: bool
    restore_from: str


def group_unsupported(memory: GroupMemory, group_modes: frozenset[str],
                      written: Collection[str]) -> list[tuple[str, str]]:
    """(setting, why) for each group setting of `memory` that a runner with `group_modes` cannot
    honour; one counts when the policy writes it or it is not the default (`GROUP_SETTINGS`'s
    first value)."""
    out = []
    modes = ", ".join(sorted(m for m in group_modes if " " not in m))
    for name, value in (("kv_exchange", memory.kv_exchange), ("microbatch", memory.microbatch)):
        if (name in written or value != GROUP_SETTINGS[name][0]) and value not in group_modes:
            why = (f"its runner runs KunServe groups with: {modes}" if modes else
                   "its runner cannot run KunServe pipeline groups; the simulator's can")
            out.append((name, f"{name} {value} is not supported by this engine ({why})"))
    for name, value in (("restore_prefetch", _on(memory.restore_prefetch)),
                        ("restore_from", memory.restore_from)):
        usual = GROUP_SETTINGS[name][0]
        honoured = f"{name} {value}" in group_modes or (value == usual and bool(group_modes))
        if (name in written or value != usual) and not honoured:
            why = ("its runner restores a KunServe group only prefetched from peers while the "
                   "group serves" if group_modes else
                   "its runner cannot run KunServe pipeline groups")
            out.append((name, f"{name} {value} is not supported by this engine ({why})"))
    return out


def _on(flag: bool) -> str:
    return "on" if flag else "off"
