"""Checks `shunter bench` makes around its runs: every policy compiles before the first run
starts, and a warning when runs came out identical because the workload gave the policies
nothing to tell requests apart by."""

from __future__ import annotations

from collections.abc import Sequence

from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.run import RunOutcome
from shunter.workloads.workload import Workload


def check_policies(choices: Sequence[PolicyChoice]) -> None:
    """Compile every policy file (PolicyError names the file, line and column), so a broken
    second policy fails before the first run rather than after it."""
    from policy_lang import load_policy_file  # the compiler loads Lark

    for choice in choices:
        load_policy_file(choice.path)


def identical_runs_warning(workload: Workload, outcomes: Sequence[RunOutcome]) -> str | None:
    """A warning when two or more runs have the same metrics and the workload carries one
    priority, one class and one tenant: the policies had nothing to order by."""
    uniform = uniform_fields(workload)
    if uniform is None:
        return None
    groups: dict[str, list[str]] = {}
    for o in outcomes:
        if o.error is None and o.metrics is not None:
            served = {k: v for k, v in o.metrics.as_dict().items() if k not in _MEASURED}
            groups.setdefault(repr(served), []).append(o.label)
    same = [labels for labels in groups.values() if len(labels) > 1]
    if not same:
        return None
    runs = "; ".join(" and ".join(labels) for labels in same)
    return (f"warning: {runs} produced identical results: every request of workload "
            f"{workload.name} has {uniform}, so the policies have nothing to order by")


_MEASURED = frozenset({"scheduler_ms_per_iteration", "scheduler_share", "cost_model_error"})
"""Metrics timed on the host (the scheduler's own cost), which differ run to run."""


def uniform_fields(workload: Workload) -> str | None:
    """`priority P, class C and tenant T` when every request shares them; else None."""
    priorities = {r.priority for r in workload.requests}
    classes = {r.request_class for r in workload.requests} | {
        b.request_class for b in workload.batches}
    tenants = {r.tenant for r in workload.requests} | {b.tenant for b in workload.batches}
    if len(priorities) > 1 or len(classes) > 1 or len(tenants) > 1:
        return None
    p, c, t = (next(iter(s), "-") for s in (priorities or {0}, classes, tenants))
    return f"priority {p}, class {c} and tenant {t}"
