"""Where the engine's policy comes from: a policy object, policy text, a `.policy` file, or the
shipped `policies/fcfs.policy`; always checked against what this engine has built."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import structlog

from engine.config import EngineConfig
from engine.errors import PolicyError
from engine.policy import EngineCapabilities, FcfsPolicy, Policy, ensure_supported

log = structlog.get_logger(actor="engine")


def cpu_swap_blocks(config: EngineConfig, device_blocks: range) -> int:
    """Host KV blocks: `config.cpu_swap_blocks`, or as many as the device has."""
    if config.cpu_swap_blocks is not None:
        return config.cpu_swap_blocks
    return len(device_blocks)


def engine_capabilities(config: EngineConfig, backend: Any = None) -> EngineCapabilities:
    """The mechanisms an engine built from `config` has. Preemption by recompute always; swap
    (both granularities, every swap-in mode, KV reuse across turns) when the backend's runner
    can make a swapper and the config leaves it host blocks (`cpu_swap_blocks` is not 0)."""
    runner = getattr(backend, "runner", None)
    if config.cpu_swap_blocks == 0 or not hasattr(runner, "make_swapper"):
        return EngineCapabilities()
    return EngineCapabilities(
        preempt_modes=frozenset({"recompute", "never", "swap"}),
        swap_granularities=frozenset({"per-block", "groups"}),
        swap_in_modes=frozenset({"sync", "async", "adaptive"}), kv_reuse=True)


def initial_policy(config: EngineConfig, policy: Policy | None,
                   capabilities: EngineCapabilities) -> Policy:
    """`policy` when given, else the file `config.policy`, else `policies/fcfs.policy` (the
    hand-written FcfsPolicy if the shipped file cannot be read)."""
    from policy_lang import load_policy_file

    if policy is not None:
        ensure_supported(policy, capabilities)
        return policy
    if config.policy is not None:
        return load_policy_file(config.policy, capabilities=capabilities)
    from policies import policy_path

    try:
        return load_policy_file(policy_path("fcfs"), capabilities=capabilities)
    except PolicyError as exc:
        log.warning("cannot load the shipped fcfs policy; running the built-in FCFS", error=str(exc))
        return FcfsPolicy()


def replacement(new: Policy | str, current: Policy, capabilities: EngineCapabilities,
                base_dir: Path | None = None) -> Policy:
    """The policy to switch to: `new` itself, or `new` compiled from text (`include` and
    `extends` resolved from `base_dir`, else from the running policy's directory, else from the
    shipped policies). Raises PolicyError when it does not compile or needs a mechanism this
    engine lacks; the running policy is then untouched."""
    if not isinstance(new, str):
        ensure_supported(new, capabilities)
        return new
    from policies import policy_dir
    from policy_lang import compile_policy

    base = base_dir or getattr(current, "base_dir", None) or policy_dir()
    return compile_policy(new, filename="<replacement>", base_dir=Path(base),
                          capabilities=capabilities)


def source_diff(old: Policy, new: Policy) -> str:
    """Unified diff of the two policies' sources."""
    lines = difflib.unified_diff(
        old.source.splitlines(keepends=True), new.source.splitlines(keepends=True),
        fromfile=f"{old.settings.name} (running)", tofile=f"{new.settings.name} (new)")
    return "".join(lines)
