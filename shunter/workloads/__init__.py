"""Workloads for `shunter bench`: real traces, length tables with synthetic arrivals, multi-turn
conversations and BROS's best-effort batches, all seeded and named by a spec string."""

from shunter.workloads.build import load_workload
from shunter.workloads.spec import KEYS, WORKLOADS, WorkloadSpecError, help_text, parse_spec
from shunter.workloads.traces import DEFAULT_TRACES_DIR, TraceError
from shunter.workloads.workload import BatchSource, RequestSpec, Workload

__all__ = [
    "BatchSource", "DEFAULT_TRACES_DIR", "KEYS", "RequestSpec", "TraceError", "WORKLOADS",
    "Workload", "WorkloadSpecError", "help_text", "load_workload", "parse_spec",
]
