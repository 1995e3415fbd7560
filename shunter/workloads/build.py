"""Turn a spec (name + keys) into a `Workload`: read or generate, window, scale, annotate."""

from __future__ import annotations

import random
from pathlib import Path

import attrs

import shunter.workloads.synthetic as synthetic
import shunter.workloads.traces as traces
from shunter.workloads.bros import bros_table
from shunter.workloads.spec import (
    BROS_TABLES, TABLES, TRACES, WORKLOADS, Keys, WorkloadSpecError, parse_spec,
)
from shunter.workloads.workload import BatchSource, RequestSpec, Workload, rescale, window

BROS_TTFT_MS, BROS_TPOT_MS = 400.0, 200.0
"""RT SLOs of BROS §7.1."""


def load_workload(spec: str, *, traces_dir: Path | None = None, seed: int | None = None) -> Workload:
    """The workload a spec string (or TOML file) names. `seed` is the default for its `seed`."""
    name, raw = parse_spec(spec)
    if seed is not None:
        raw.setdefault("seed", str(seed))
    keys = Keys(raw, spec)
    return build(name, keys, Path(traces_dir) if traces_dir else traces.DEFAULT_TRACES_DIR)


def build(name: str, keys: Keys, traces_dir: Path) -> Workload:
    seed = keys.integer("seed", 0)
    if name == "be-batch":
        specs, duration = [], keys.number("duration", None)
        batches = (_batch_source(keys, seed, stop=duration, default_batches=10),)
    elif name == "rtbe":
        rt = keys.text("rt", "sharegpt-bros")
        if rt not in WORKLOADS or rt in ("rtbe", "be-batch"):
            raise WorkloadSpecError(f"{keys.where}: rt={rt!r} must name an RT workload")
        specs, duration = _open_loop(rt, keys, traces_dir, seed, default_duration=600.0)
        batches = (_batch_source(keys, seed, stop=duration, default_batches=None),)
    else:
        specs, duration = _open_loop(name, keys, traces_dir, seed, default_duration=None)
        batches = ()
    specs = _annotate(specs, keys, seed)
    scale = keys.number("scale_lengths", 1.0)
    return Workload(name=name, description=WORKLOADS[name], params=dict(keys.used),
                    requests=tuple(specs), batches=batches, duration_s=duration or 0.0,
                    length_scale=scale, seed=seed)


def _open_loop(name: str, keys: Keys, traces_dir: Path, seed: int,
               default_duration: float | None) -> tuple[list[RequestSpec], float | None]:
    rng = random.Random(f"{seed}/{name}")
    mult, per_s = keys.rate()
    if name in TRACES:
        read = traces.read_azure if name.startswith("azure") else traces.read_mooncake
        start, duration = keys.number("start", 0.0), keys.number("duration", default_duration)
        specs = window(read(traces_dir, name), start=start, duration=duration,
                       cap=keys.integer("requests", None))
        if not specs:
            raise WorkloadSpecError(f"{keys.where}: no request of {name} arrives in the window")
        span = duration or (specs[-1].arrival_s or 1.0)
        time = mult or (per_s * span / len(specs) if per_s else 1.0)
        duration = span / time
    else:
        time, duration = 1.0, keys.number("duration", default_duration)
        rate = per_s or (1.0 if name != "multiturn" else 0.5)
        if mult:
            rate *= mult
        process, cv = keys.text("arrival", "poisson"), keys.number("cv", 2.0)
        table_name = keys.text("table", "sharegpt") if name == "multiturn" else name
        if table_name in BROS_TABLES:
            table = bros_table(table_name, traces_dir)
        elif table_name not in TABLES:
            raise WorkloadSpecError(f"{keys.where}: table={table_name!r}; known: {', '.join(TABLES)}")
        else:
            table = traces.read_length_table(traces_dir, table_name)
        n = keys.integer("conversations" if name == "multiturn" else "requests",
                         None if duration else (50 if name == "multiturn" else 200))
        try:
            times = synthetic.arrivals(rng, rate=rate, n=n, until=duration, process=process, cv=cv)
        except ValueError as exc:
            raise WorkloadSpecError(f"{keys.where}: {exc}") from None
        if name == "multiturn":
            specs = synthetic.multiturn(rng, table, times, mean_turns=keys.number("turns", 5.5),
                                        mean_think_s=keys.number("think", 5.0),
                                        max_context=keys.integer("max_len", 8192))
        else:
            specs = synthetic.from_length_table(rng, table, times)
        duration = duration or (times[-1] if times else 0.0)
    specs = rescale(specs, time=time, lengths=keys.number("scale_lengths", 1.0),
                    max_input=keys.integer("max_input", None),
                    max_output=keys.integer("max_output", None))
    return specs, duration


def _batch_source(keys: Keys, seed: int, stop: float | None,
                  default_batches: int | None) -> BatchSource:
    batches = keys.integer("batches", default_batches)
    if stop is None and batches is None:
        raise WorkloadSpecError(f"{keys.where}: BE batches need a duration or a number of batches")
    return BatchSource(batch_size=keys.integer("batch_size", 32),
                       prompt_range=keys.span("be_prompt", (512, 1024)),
                       output_range=keys.span("be_output", (32, 128)),
                       stop_s=stop, max_batches=batches, seed=seed)


def _annotate(specs: list[RequestSpec], keys: Keys, seed: int) -> list[RequestSpec]:
    """Tenants, SLOs and initial priorities (whole conversations share tenant and chain)."""
    ttft = keys.number("ttft_ms", BROS_TTFT_MS) or None
    tpot = keys.number("tpot_ms", BROS_TPOT_MS) or None
    tenants = keys.integer("tenants", 1)
    pattern = keys.text("priority", "none")
    levels = keys.integer("levels", 4)
    if pattern not in ("none", "random", "markov"):
        raise WorkloadSpecError(f"{keys.where}: priority={pattern!r}; known: none, random, markov")
    rng = random.Random(f"{seed}/annotate")
    tenant_of: dict[str, str] = {}
    prio: dict[int, int] = {}
    out = []
    for s in specs:
        conv = s.conversation_id or f"r{s.index}"
        if conv not in tenant_of:
            tenant_of[conv] = f"t{rng.randrange(tenants)}" if tenants > 1 else "default"
        p = 0
        if pattern == "random":
            p = rng.randrange(levels)
        elif pattern == "markov":
            before = prio.get(s.parent) if s.parent is not None and s.after_parent_s is not None else None
            p = before if before is not None and rng.random() < 0.8 else rng.randrange(levels)
        prio[s.index] = p
        out.append(attrs.evolve(s, tenant=tenant_of[conv], ttft_ms=ttft, tpot_ms=tpot, priority=p))
    return out
