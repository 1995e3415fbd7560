"""The Markdown tables of `bench/sim_validation.py`'s JSON report (issue 18)."""

from __future__ import annotations

import statistics
from typing import Any

METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "output_tokens_per_s")


def _errors(err: Any) -> str:
    if not isinstance(err, dict):
        return str(err) if err else "-"
    return " / ".join(f"{err[k]:+.0%}" for k in METRICS)


def _header(report: dict[str, Any]) -> list[str]:
    cal = report.get("calibration_rounds", 1)
    return ["# Simulator vs torch backend (issue 18)", "",
            (f"`python bench/sim_validation.py --threads {report['threads']} --repeats "
             f"{report['repeats']} --calibration-rounds {cal}"
             f"{'' if report.get('grid', True) else ' --no-grid'}`, {report['started']} - "
             f"{report['ended']} UTC. Each cell: the sim's error against the median of "
             f"{report['repeats']} torch runs [the torch runs' own spread: their largest distance "
             f"from that median]; **bold** where it lies outside both 20% and that spread. "
             f"`grid profile`: the same four errors for the method this replaces (a grid of "
             f"shapes timed alone, in-engine calibrated, no engine cost), fitted in the same "
             f"window (`-`: not run). `in-sample replay`: the four errors of a sim whose profile was fitted on "
             f"the first torch run itself, against that run, with and without the engine's cost: "
             f"the simulator's own error, apart from the fit's."), ""]


def _fit_line(m: dict[str, Any]) -> str:
    f, g = m["fit"], m["fit"].get("grid_fit")
    e = m["profile"]["engine_cost"]
    line = (f"Cost model fitted on {f['rows']} recorded steps ({f.get('calibration_runs', 5)} "
            f"calibration runs): median error {f['train_median_relative_error']:.1%}; on the "
            f"{f['held_out_rows']} steps of the validation runs (held out): median "
            f"{f['held_out_median_relative_error']:.1%}, total time predicted/measured "
            f"{f['held_out_predicted_over_measured_total']:.3f} (")
    parts = [(f"grid profile: {g['held_out_median_relative_error']:.1%}, "
              f"{g['held_out_predicted_over_measured_total']:.3f}")] if g else []
    no_g = f.get("no_multi_row")
    if no_g:
        parts.append(f"without the multi-row term: {no_g['held_out_median_relative_error']:.1%}, "
                     f"{no_g['held_out_predicted_over_measured_total']:.3f}")
    line += "; ".join(parts)
    one = f.get("one_round")
    if one:
        line += (f"; fitted on the first calibration round alone: "
                 f"{one['held_out_median_relative_error']:.1%}, "
                 f"{one['held_out_predicted_over_measured_total']:.3f}")
    line += (f"). Engine cost charged: {e['per_iteration_ms']:.3f} ms per iteration + "
             f"{e['per_seq_ms']:.4f} per sequence + {e['per_sampled_ms']:.4f} per sampled token, "
             f"{e['before_share']:.0%} of it before the step"
             + (f", plus the sim's own planning time x{e['planning_scale']:.2f} (torch's planning "
                f"over the sim's on the first calibration round)"
                if e.get("planning_scale") else "")
             + (f"; swaps reach the copier {e['copy_start_ms']:.2f} ms after their plan"
                + (" ends" if e.get("planning_scale") else "") if e.get("copy_start_ms") else "")
             + (f"; an idle copier starts copying {e['copy_pickup_ms']:.3f} ms after a swap reaches "
                f"it (its worker's wake-up), and a step that waited for a copy resumes "
                f"{e.get('wake_ms', 0.0):.3f} ms after it ends" if e.get("copy_pickup_ms") else "")
             + ".")
    c = m["profile"].get("copy_contention")
    if c:
        line += (f" Copies beside the engine (fitted on the calibration runs' copies): "
                 f"+{c['engine']:.2f} ms of engine time and +{c['step']:.2f} ms of step time per "
                 f"ms of copying beside them ({c['source'].split('; ', 1)[-1]})"
                 + (f"; +{c['swapped_in_ms']:.3f} ms of step time per swap-in the step waited for"
                    if c.get("swapped_in_ms") else "") + ".")
    ratios = m.get("planning_ratio_by_case")
    if ratios:
        line += (" Torch's planning over the sim's, per workload (first calibration round): "
                 + ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items()) + ".")
    return line


def _model_table(m: dict[str, Any]) -> list[str]:
    lines = [("| workload | TTFT p50 | TTFT p99 | TPOT p50 | output tok/s | grid profile | "
              "in-sample replay, charged; uncharged | torch load avg | swap iterations, "
              "stall s torch / sim, copy s torch / model |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in m["results"]:
        cells = []
        for k in METRICS:
            v = r["judged"][k]
            cell = f"{v['error']:+.1%} [{v['torch_spread']:.1%}]"
            cells.append(cell if v["within"] else f"**{cell}**")
        loads = [t["load_after"][0] for t in r["torch"]]
        swaps = statistics.median(t["swap_iteration_share"] for t in r["torch"])
        stall_t = statistics.median(t["swap_stall_s"] for t in r["torch"])
        stall_s = statistics.median(t["swap_stall_s"] for t in r["sim"])
        rep = r["in_sample_replay"]
        rep_cell = "; ".join(_errors(rep[v]) for v in ("charged", "uncharged"))
        lines.append(f"| {r['case']} | " + " | ".join(cells)
                     + f" | {_errors(r.get('grid_profile', {}).get('error'))} | {rep_cell} | "
                     f"{min(loads):.2f}-{max(loads):.2f} | {swaps:.0%}, {stall_t:.2f} / {stall_s:.2f}, "
                     f"{statistics.median(r['copies']['torch_s']):.3f} / "
                     f"{statistics.median(r['copies']['model_s']):.3f} |")
    return lines


def _variants(m: dict[str, Any]) -> list[str]:
    if not any("one_round_error" in r or "no_contention_error" in r for r in m["results"]):
        return []
    lines = ["", ("Variants, same four errors against the same torch medians (TTFT p50 / p99 / "
                  "TPOT p50 / tok/s): the profile above; fitted on the first calibration round "
                  "alone; the profile above with copies overlapping for free (no contention "
                  "charge); the scheduler's planning left inside the fitted engine cost and not "
                  "charged apart (round 2's method); without the copier's pickup, wake-up and "
                  "swapped-in charge (round 3's mechanics); every step 5% longer (how far a small "
                  "step-model error moves each metric):"), "",
             ("| workload | profile | one calibration round | copies free | planning in the "
              "engine cost | round 3's mechanics | steps x1.05 |"), "|---|---|---|---|---|---|---|"]
    for r in m["results"]:
        main = {k: r["judged"][k]["error"] for k in METRICS}
        lines.append(f"| {r['case']} | {_errors(main)} | {_errors(r.get('one_round_error'))} | "
                     f"{_errors(r.get('no_contention_error'))} | "
                     f"{_errors(r.get('gross_planning_error'))} | "
                     f"{_errors(r.get('round3_mechanics_error'))} | "
                     f"{_errors(r.get('steps_x1.05_error'))} |")
    return lines


def _breakdown(m: dict[str, Any]) -> list[str]:
    lines = ["", ("Where the clocks part, on the validation runs' steps (predicted / measured "
                  "total step time per kind of step, recorded-steps profile vs grid profile; the "
                  "engine's own time between back-to-back steps against their step time):"), "",
             "| workload | prefill-only | mixed | decode-only | engine gap (median ms, share) |",
             "|---|---|---|---|---|"]
    for r in m["results"]:
        b = r["breakdown"]
        cells = []
        for k in ("prefill", "mixed", "decode"):
            if k in b:
                grid = b[k].get("grid_predicted_over_measured")
                cells.append(f"{b[k]['share_of_step_time']:.0%} of time: "
                             f"{b[k]['recorded_predicted_over_measured']:.2f}"
                             + (f" vs {grid:.2f}" if grid is not None else ""))
            else:
                cells.append("-")
        lines.append(f"| {r['case']} | " + " | ".join(cells) +
                     f" | {b['engine_gap_ms_median']:.2f}, {b['engine_gap_over_step_time']:.1%} |")
    for key, what in (("decode_by_context", "context per sequence"),
                      ("decode_by_seqs", "sequences in the batch")):
        ctx = [(r["case"], r["breakdown"].get(key)) for r in m["results"]]
        if not any(c for _, c in ctx):
            continue
        bins = sorted({b["bin"] for _, c in ctx for b in c or ()},
                      key=lambda b: int(b.split("-")[0].rstrip("+")))
        lines += ["", (f"Decode-only steps of the validation runs by {what}: predicted / "
                       f"measured total time (steps):"), "",
                  "| workload | " + " | ".join(bins) + " |", "|---|" + "---|" * len(bins)]
        for case, c in ctx:
            cells = {b["bin"]: f"{b['predicted_over_measured']:.2f} ({b['steps']})" for b in c or ()}
            lines.append(f"| {case} | " + " | ".join(cells.get(b, "-") for b in bins) + " |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    lines = _header(report)
    for name, m in report["models"].items():
        lines += [(f"## {name}: {m['model']['layers']} layers, hidden {m['model']['hidden']} "
                   f"(rates x{m['rate_scale']})"), "", _fit_line(m), ""]
        lines += _model_table(m)
        sim_spread = max((max(x[k] for x in r["sim"]) - min(x[k] for x in r["sim"]))
                         / max(abs(statistics.median(x[k] for x in r["sim"])), 1e-12)
                         for r in m["results"] for k in METRICS)
        lines += ["", (f"The sim's {report['repeats']} runs of each workload differ by at most "
                       f"{sim_spread:.2%} in any of these metrics (the planning time it charges "
                       f"is its own, measured in each run).")]
        lines += _variants(m)
        lines += _breakdown(m)
        lines.append("")
    return "\n".join(lines) + "\n"
