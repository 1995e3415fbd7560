"""Where the engine's policy comes from: a policy object, policy text, a `.policy` file, or the
shipped `policies/fcfs.policy`; always checked against the mechanisms this engine has."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

# `policy_lang.compile_policy` and `load_policy_file` load the compiler (and Lark) on first use,
# so importing shunter, and `shunter --help`, do not pay for it.
import policy_lang
from engine.config import EngineConfig
from engine.policy import EngineCapabilities, Policy, ensure_supported
from policies import policy_dir, policy_path


def cpu_swap_blocks(config: EngineConfig, device_blocks: range) -> int:
    """Host KV blocks: `config.cpu_swap_blocks`, or as many as the device has."""
    if config.cpu_swap_blocks is not None:
        return config.cpu_swap_blocks
    return len(device_blocks)


def engine_capabilities(config: EngineConfig, backend: Any = None) -> EngineCapabilities:
    """The mechanisms an engine built from `config` has. Preemption by recompute always; swap
    (both granularities, every swap-in mode, KV reuse across turns) when the backend's runner
    can make a swapper and the config leaves it host blocks (`cpu_swap_blocks` is not 0)."""
    groups = frozenset(getattr(getattr(backend, "runner", None), "GROUP_MODES", ()))
    if config.cpu_swap_blocks == 0:
        return EngineCapabilities(
            no_swap="this engine has no swap space: --cpu-swap-blocks is 0", group_modes=groups)
    if not hasattr(getattr(backend, "runner", None), "make_swapper"):
        return EngineCapabilities(
            no_swap="this engine was started with a backend that cannot swap", group_modes=groups)
    return EngineCapabilities(
        preempt_modes=frozenset({"recompute", "never", "swap"}),
        swap_granularities=frozenset({"per-block", "groups"}),
        swap_in_modes=frozenset({"sync", "async", "adaptive"}), kv_reuse=True, group_modes=groups)


def initial_policy(config: EngineConfig, policy: Policy | None,
                   capabilities: EngineCapabilities) -> Policy:
    """`policy` when given, else the file `config.policy`, else `policies/fcfs.policy`."""
    if policy is not None:
        ensure_supported(policy, capabilities)
        return policy
    path = config.policy if config.policy is not None else policy_path("fcfs")
    return policy_lang.load_policy_file(path, capabilities=capabilities)


def replacement(new: Policy | str, current: Policy, capabilities: EngineCapabilities,
                base_dir: Path | None = None) -> Policy:
    """The policy to switch to: `new` itself, or `new` compiled from text (`include` and
    `extends` resolved from `base_dir`, else from the running policy's directory, else from the
    shipped policies). Raises PolicyError when it does not compile, needs a mechanism this
    engine lacks, or swaps at another granularity than the device allocator runs (`capabilities`
    once `running`); the running policy is then untouched."""
    if not isinstance(new, str):
        ensure_supported(new, capabilities)
        return new
    base = base_dir or getattr(current, "base_dir", None) or policy_dir()
    return policy_lang.compile_policy(new, filename="<replacement>", base_dir=Path(base),
                                      capabilities=capabilities)


def source_diff(old: Policy, new: Policy) -> str:
    """Unified diff of the two policies' sources."""
    lines = difflib.unified_diff(
        old.source.splitlines(keepends=True), new.source.splitlines(keepends=True),
        fromfile=f"{old.settings.name} (running)", tofile=f"{new.settings.name} (new)")
    return "".join(lines)
