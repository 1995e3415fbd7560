"""The KunServe ladder's step-by-step contributions (bench/kunserve.py writes them into its JSON
as `ladder` and under its table), beside the paper's numbers."""

from __future__ import annotations

PAPER_LADDER = {"drop_p99_ttft_vs_best": 11.7, "exchange_p99_ttft_gain": 1.5,
                "lookahead_p99_tpot_change": -0.106, "bubble_without_lookahead": 0.219,
                "bubble_with_lookahead": 0.083, "cost_model_error": 0.05,
                "restore_p50_ttft_change": -0.28, "restore_p50_tpot_change": -0.23}
"""KunServe §5.3 (LongBench, Qwen-2.5-14B: Figure 14), §5.4 (Figure 15: under 5%) and §5.5
(Figure 16, BurstGPT long run)."""


def ladder(runs: dict) -> dict:
    """Each step of the ladder against the step before it (the paper's ablation, §5.3-5.5):
    drop alone against the best KV-centric baseline (P99 TTFT), coordinated exchange against
    drop alone (P99 TTFT, activation stall), lookahead against exchange (P99 TPOT, bubble
    ratio over all grouped steps and over those with a microbatch per stage, the Eq. 1-3
    model's error), restore against lookahead (P50 TTFT and TPOT)."""
    def get(label: str, key: str, cluster: bool = False):
        r = runs.get(label) or {}
        return (r.get("cluster") or {}).get(key) if cluster else r.get(key)

    kv = [r for r in ("vllm_dp", "infercept_swap") if r in runs]
    best = min(kv, key=lambda r: runs[r]["ttft_p99_s"]) if kv else None
    out: dict = {"paper": PAPER_LADDER, "best_kv_centric": best}
    drop, ex = "kunserve_drop", "kunserve_exchange"
    la, full = "kunserve_lookahead", "kunserve"
    if best and drop in runs:
        out["drop_p99_ttft_vs_best"] = runs[best]["ttft_p99_s"] / runs[drop]["ttft_p99_s"]
    if drop in runs and ex in runs:
        out["exchange_p99_ttft_gain"] = runs[drop]["ttft_p99_s"] / runs[ex]["ttft_p99_s"]
        out["activation_stall_s"] = [get(drop, "activation_stall_s", True),
                                     get(ex, "activation_stall_s", True)]
    if ex in runs and la in runs:
        out["lookahead_p99_tpot_change"] = runs[la]["tpot_p99_ms"] / runs[ex]["tpot_p99_ms"] - 1
        out["lookahead_p50_tpot_change"] = runs[la]["tpot_p50_ms"] / runs[ex]["tpot_p50_ms"] - 1
        out["bubble_without_lookahead"] = get(ex, "bubble_ratio", True)
        out["bubble_with_lookahead"] = get(la, "bubble_ratio", True)
        out["bubble_full_steps_without"] = get(ex, "bubble_ratio_full_steps", True)
        out["bubble_full_steps_with"] = get(la, "bubble_ratio_full_steps", True)
        out["short_step_share"] = [get(ex, "short_step_share", True),
                                   get(la, "short_step_share", True)]
        for key in ("cost_model_error", "token_model_error", "cost_model_error_in_run",
                    "token_model_error_in_run", "paper_eq1_error_in_run"):
            out[key] = get(la, key, True)
    if la in runs and full in runs:
        out["restore_p50_ttft_change"] = runs[full]["ttft_p50_s"] / runs[la]["ttft_p50_s"] - 1
        out["restore_p50_tpot_change"] = runs[full]["tpot_p50_ms"] / runs[la]["tpot_p50_ms"] - 1
        out["restore_p99_ttft_change"] = runs[full]["ttft_p99_s"] / runs[la]["ttft_p99_s"] - 1
    return out


def ladder_lines(lad: dict) -> list[str]:
    """The ladder block as table rows, beside the paper's numbers."""
    if not lad:
        return []

    def fmt(v, kind):
        if v is None:
            return "-"
        if isinstance(v, list):
            return " -> ".join(fmt(x, kind) for x in v)
        return f"{v:.2f}x" if kind == "x" else f"{v:+.1%}" if kind == "d" else f"{v:.1%}" \
            if kind == "p" else f"{v:.3f} s"

    rows = [("drop alone: P99 TTFT, best KV-centric / kunserve_drop", "drop_p99_ttft_vs_best", "x"),
            ("+ coordinated exchange: P99 TTFT, drop / exchange", "exchange_p99_ttft_gain", "x"),
            ("  activation stall, drop -> exchange", "activation_stall_s", "s"),
            ("+ lookahead: P99 TPOT change", "lookahead_p99_tpot_change", "d"),
            ("  P50 TPOT change", "lookahead_p50_tpot_change", "d"),
            ("  bubble ratio without lookahead (all grouped steps)", "bubble_without_lookahead", "p"),
            ("  bubble ratio with lookahead (all grouped steps)", "bubble_with_lookahead", "p"),
            ("  bubble, steps with a microbatch per stage, without", "bubble_full_steps_without", "p"),
            ("  bubble, steps with a microbatch per stage, with", "bubble_full_steps_with", "p"),
            ("  grouped steps with fewer microbatches than stages", "short_step_share", "p"),
            ("  Eq. 1-3 error, held-out random microbatches", "cost_model_error", "p"),
            ("  token-count model error, same", "token_model_error", "p"),
            ("  Eq. 1-3 error on the microbatches run", "cost_model_error_in_run", "p"),
            ("  token-count model error on them", "token_model_error_in_run", "p"),
            ("  Eq. 1 as published (one prefix coefficient) on them", "paper_eq1_error_in_run",
             "p"),
            ("+ restore: P50 TTFT change", "restore_p50_ttft_change", "d"),
            ("  P50 TPOT change", "restore_p50_tpot_change", "d"),
            ("  P99 TTFT change", "restore_p99_ttft_change", "d")]
    paper = lad.get("paper", {})
    out = ["", "Ladder (each step against the one before; paper: KunServe §5.3-5.5):", "",
           "| step | here | paper |", "|---|---|---|"]
    for name, key, kind in rows:
        if key in lad:
            out.append(f"| {name} | {fmt(lad[key], kind)} | "
                       f"{fmt(paper[key], kind) if key in paper else ''} |")
    return out
