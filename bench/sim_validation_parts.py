"""Parts of `bench/sim_validation.py` (issue 18): where the clocks part on the recorded steps,
and the profile variants it runs beside the fitted profile.

- `breakdown`: per kind of step, the fitted model's predicted / measured step time; decode-only
  steps by context and batch size; the engine's own gaps.
- `without_hops`: the profile less round 4's copier hops (`EngineCost.copy_pickup_ms`,
  `wake_ms`, `CopyContention.swapped_in_ms`): round 3's mechanics, for a before/after in the
  same window.
- `scaled_steps`: every step `factor` times longer: how far each metric moves for a small error
  in the step model (the swap-heavy case sits near saturation, where a few percent of step time
  move its latencies by tens of percent).
- `planning_ratio`: torch's planning per iteration over the sim's, per workload (the sim charges
  its own planning times one ratio per model: is it the same for every policy?).
"""

from __future__ import annotations

import statistics
from typing import Any

import attrs

from shunter.fidelity import RecordedRun, engine_gaps, fit_rows
from sim.fit import total_ratio
from sim.profile import Profile

CONTEXT_BINS = ((0, 64), (64, 128), (128, 256), (256, 512), (512, 1 << 30))
SEQ_BINS = ((1, 2), (2, 3), (3, 5), (5, 9), (9, 1 << 30))


def kind(shape: Any) -> str:
    if shape.prefill_tokens and shape.decode_seqs:
        return "mixed"
    return "prefill" if shape.prefill_tokens else "decode"


def breakdown(runs: list[RecordedRun], profiles: dict[str, Any]) -> dict[str, Any]:
    """Where the clocks part on the validation runs' steps: per step kind, its share of the
    measured step time and each profile's predicted/measured total; the engine's own time
    between back-to-back steps against the step time."""
    rows = fit_rows(runs)
    out: dict[str, Any] = {}
    for k in ("prefill", "mixed", "decode"):
        part = [(s, ms) for s, ms in rows if kind(s) == k]
        if part:
            out[k] = {"steps": len(part), "share_of_step_time": sum(ms for _, ms in part)
                      / sum(ms for _, ms in rows),
                      **{f"{name}_predicted_over_measured": total_ratio(p.cost, part)
                         for name, p in profiles.items()}}
    decode = [(s, ms) for s, ms in rows if kind(s) == "decode"]
    per_seq = [s.decode_context / s.decode_seqs for s, _ in decode]
    out["decode_by_context"] = []
    for lo, hi in CONTEXT_BINS:  # a long-context term the linear model lacks would show here
        part = [row for row, c in zip(decode, per_seq) if lo <= c < hi]
        if part:
            out["decode_by_context"].append({
                "bin": f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+", "steps": len(part),
                "predicted_over_measured": total_ratio(profiles["recorded"].cost, part)})
    out["decode_by_seqs"] = []
    for lo, hi in SEQ_BINS:  # a batch-size curve the linear model lacks would show here
        part = [(s, ms) for s, ms in decode if lo <= s.decode_seqs < hi]
        if part:
            out["decode_by_seqs"].append({
                "bin": f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}" if hi < 1 << 30 else f"{lo}+",
                "steps": len(part), "predicted_over_measured": total_ratio(profiles["recorded"].cost, part)})
    gaps = [(s, g) for r in runs for s, g, _ in engine_gaps(r)]
    out["engine_gap_ms_median"] = statistics.median(g for _, g in gaps) if gaps else 0.0
    out["engine_gap_over_step_time"] = (sum(g for _, g in gaps) / sum(s.compute_ms for s, _ in gaps)
                                        if gaps else 0.0)
    return out


def without_hops(profile: Profile) -> Profile:
    """`profile` without the copier's pickup and wake-up and the swapped-in step charge."""
    engine = profile.engine_cost and attrs.evolve(profile.engine_cost, copy_pickup_ms=0.0,
                                                  wake_ms=0.0)
    contention = profile.copy_contention and attrs.evolve(profile.copy_contention,
                                                          swapped_in_ms=0.0)
    return attrs.evolve(profile, engine_cost=engine, copy_contention=contention)


def scaled_steps(profile: Profile, factor: float) -> Profile:
    """`profile` with every step `factor` times as long (every cost-model coefficient)."""
    c = profile.cost
    return attrs.evolve(profile, cost=attrs.evolve(
        c, a_ms=c.a_ms * factor, b_ms_per_prefill_token=c.b_ms_per_prefill_token * factor,
        c_ms_per_prefill_token_sq=c.c_ms_per_prefill_token_sq * factor,
        d_ms_per_decode_seq=c.d_ms_per_decode_seq * factor,
        e_ms_per_decode_context_token=c.e_ms_per_decode_context_token * factor,
        f_ms_per_prefill_prefix_token=c.f_ms_per_prefill_prefix_token * factor,
        g_ms_multi_row=c.g_ms_multi_row * factor))


def planning_ratio(run: RecordedRun, sim_ms_per_iteration: float) -> float:
    """Torch's mean planning CPU time per iteration of `run` over the sim's of the same workload."""
    return statistics.fmean(run.scheduler_s) * 1000.0 / sim_ms_per_iteration
