"""KunServe's restore settings in the policy language (`memory { restore_prefetch on|off;
restore_from peer|host }`, §4.4): their defaults keep a restore prefetched from peers, a bad
value is an error at its place in the file, and an engine whose runner cannot honour a value
refuses it at load with the setting's file:line:col: a runner that runs groups but names no
restore mode takes only the defaults, an engine that runs no groups takes none of them. The
torch runner honours all four (its test: tests/cluster/test_kunserve_torch_cluster_restore.py),
and so does the simulator (shunter/cluster/sim_restore.py; its test:
tests/sim/test_kunserve_restore_modes.py)."""

from __future__ import annotations

import pytest

from engine.policy import EngineCapabilities
from gpu.kunserve_runner import KunServeTorchRunner
from policies import policy_dir, policy_path
from policy_lang import compile_policy, load_policy_file
from shunter import PolicyCheckError
from sim.runner import SimRunner

OFF = ('policy k extends "kunserve.policy" {\n'
       '  memory { restore_prefetch off; restore_from host }\n}\n')


def _caps(runner) -> EngineCapabilities:
    return EngineCapabilities(group_modes=frozenset(runner.GROUP_MODES))


def test_the_shipped_kunserve_policies_prefetch_from_peers():
    for name in ("kunserve_drop", "kunserve_exchange", "kunserve_lookahead", "kunserve"):
        m = load_policy_file(policy_path(name)).settings.memory
        assert (m.restore_prefetch, m.restore_from) == (True, "peer"), name
    for runner in (SimRunner, KunServeTorchRunner):  # (each loads them)
        load_policy_file(policy_path("kunserve"), capabilities=_caps(runner))


def test_a_policy_turns_the_prefetch_off_and_restores_from_the_host():
    p = compile_policy(OFF, filename="k.policy", base_dir=policy_dir(),
                       capabilities=_caps(KunServeTorchRunner))
    m = p.settings.memory
    assert (m.restore_prefetch, m.restore_from) == (False, "host")
    assert "a group restores all at once" in p.explain()
    assert "from each member's host copy" in p.explain()


def test_a_bad_value_names_its_place():
    text = 'policy k {\n  memory { restore_prefetch of }\n}\n'
    with pytest.raises(PolicyCheckError) as info:
        compile_policy(text, filename="k.policy")
    assert str(info.value) == (
        "k.policy:2:29: restore_prefetch must be one of on, off, got 'of'; did you mean 'off'?\n"
        "    memory { restore_prefetch of }\n"
        "                              ^~")


def test_the_simulator_runs_all_four_and_a_runner_that_does_not_refuses_them():
    p = compile_policy(OFF, filename="k.policy", base_dir=policy_dir(),
                       capabilities=_caps(SimRunner))  # shunter/cluster/sim_restore.py
    assert (p.settings.memory.restore_prefetch, p.settings.memory.restore_from) == (False, "host")
    groups_only = EngineCapabilities(group_modes=frozenset(
        {"fifo", "coordinated", "tokens", "lookahead"}))  # runs groups, names no restore mode
    with pytest.raises(PolicyCheckError) as info:
        compile_policy(OFF, filename="k.policy", base_dir=policy_dir(), capabilities=groups_only)
    why = ("is not supported by this engine (its runner restores a KunServe group only "
           "prefetched from peers while the group serves)")
    assert str(info.value) == (
        f"k.policy:2:12: restore_prefetch off {why}\n"
        "    memory { restore_prefetch off; restore_from host }\n"
        "             ^~~~~~~~~~~~~~~~~~~~\n"
        f"k.policy:2:34: restore_from host {why}\n"
        "    memory { restore_prefetch off; restore_from host }\n"
        "                                   ^~~~~~~~~~~~~~~~~")
    written = 'policy k {\n  memory { restore_prefetch on; restore_from peer }\n}\n'
    compile_policy(written, filename="k.policy", capabilities=groups_only)


def test_an_engine_without_groups_refuses_any_restore_setting_written():
    text = 'policy k {\n  memory { restore_from peer }\n}\n'
    with pytest.raises(PolicyCheckError, match=r"k\.policy:2:12: restore_from peer is not "
                                               r"supported by this engine \(its runner cannot "
                                               r"run KunServe pipeline groups\)"):
        compile_policy(text, filename="k.policy", capabilities=EngineCapabilities())
    compile_policy('policy k { }\n', filename="k.policy", capabilities=EngineCapabilities())


def test_the_settings_defaults_are_the_checkers_first_values():
    """engine/cluster/group_settings.py judges "not the default" by GROUP_SETTINGS' first value:
    it must be MemorySettings' default."""
    from engine.cluster.group_settings import GROUP_SETTINGS
    from engine.policy import MemorySettings

    m = MemorySettings()
    for name, values in GROUP_SETTINGS.items():
        default = getattr(m, name)
        assert ({True: "on", False: "off"}.get(default, default) if isinstance(default, bool)
                else default) == values[0], name
