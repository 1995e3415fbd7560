"""The FastSwitch ladder's results as markdown (bench/fastswitch_ladder.py writes the data), and
the torch-backend run of the ladder on the shipped model."""

from __future__ import annotations

import json
from pathlib import Path

import attrs

BLOCK_GB = 16 * 128 * 1024 / 1e9
"""One 16-token block of Llama-3-8B KV (128 KB a token), in GB."""
PAPER = {"ttft_p99": (3.7, 4.1), "tbt_p999": (2.0, 2.7)}
"""FastSwitch §5.1, LLaMA-8B on an A10: P99 TTFT and P99.9 TBT speed-ups over vLLM 0.3.3."""


def _find(rows: list[dict], prefix: str) -> dict | None:
    return next((r for r in rows if r["policy"].startswith(prefix) and "error" not in r), None)


def _x(a: float) -> str:
    return f"{a:.2f}x" if a < 100 else f"{a:.0f}x"


def sweep_table(rates: dict[str, list[dict]], pattern: str) -> list[str]:
    lines = [("| conv/s | policy | P99 TTFT s | P99.9 TBT ms | out tok/s | keeps up | TTFT x | "
             "TBT x | tput x | blocks/copy | copy calls/block: per-block layout, the paper's "
             "layer-major groups, this run | "
             "swap-out GB: preempt + turn end |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rate, rows in rates.items():
        base = _find(rows, f"vllm_baseline_{pattern}")
        for r in rows:
            if "error" in r:
                lines.append(f"| {rate} | {r['policy']} | error: {r['error']} |")
                continue
            s = r["swap"]
            v = ratios(base, r) if base else {}
            lines.append(
                f"| {rate} | {r['policy']} | {r['ttft_p99_ms'] / 1000:.2f} | {r['tbt_p999_ms']:.0f} "
                f"| {r['output_tokens_per_s']:.0f} | {'yes' if r['keeps_up'] else '**no**'} "
                f"| {_x(v.get('ttft_p99', 0))} | {_x(v.get('tbt_p999', 0))} "
                f"| {v.get('throughput', 0):.2f} | {s['blocks_per_copy']:.2f} "
                f"| {s['calls_per_block_per_block_layout']}, {s['calls_per_block_paper_groups']:.2f}, "
                f"{s['calls_per_block_ours']:.3f} "
                f"| {s['preemption_blocks_out'] * BLOCK_GB:.1f} + "
                f"{s['turn_end_blocks_out'] * BLOCK_GB:.1f} |")
    return lines


def ratios(base: dict, other: dict) -> dict:
    return {"ttft_p99": base["ttft_p99_ms"] / other["ttft_p99_ms"],
            "tbt_p999": base["tbt_p999_ms"] / other["tbt_p999_ms"],
            "throughput": other["output_tokens_per_s"] / base["output_tokens_per_s"]}


def fair_loads(rates: dict[str, list[dict]], pattern: str) -> list[str]:
    """Loads where the baseline keeps up: its queue does not grow and its throughput is
    within 5% of FastSwitch's (the issue's definition)."""
    out = []
    for rate, rows in rates.items():
        base, fast = _find(rows, f"vllm_baseline_{pattern}"), _find(rows, f"fastswitch_{pattern}")
        if base and fast and base["keeps_up"] and \
                base["output_tokens_per_s"] >= 0.95 * fast["output_tokens_per_s"]:
            out.append(rate)
    return out


def headline(data: dict) -> list[str]:
    lines = [("| pattern, frequency | load (conv/s) | baseline keeps up | P99 TTFT | P99.9 TBT | "
             "throughput | vs prefix-cached baseline (TTFT, TBT) | at x0.5 / x2 per-call cost "
             "(TTFT, TBT) |"), "|---|---|---|---|---|---|---|---|"]
    for pattern, part in data["parts"].items():
        for freq, rates in part["sweep"].items():
            fair = fair_loads(rates, pattern)
            # the loads with per-call cost variants, the highest where the baseline keeps up,
            # the first where it does not (the knee), and the highest (about the paper's 1 req/s)
            knee = [r for r in rates if r not in fair and float(r) > float(fair[-1])] if fair else []
            sens = set(part["sensitivity"].get(freq, {}).get("x2", {}))
            picks = sorted({*(r for r in rates if r in sens), *fair[-1:], *knee[:1],
                            max(rates, key=float)}, key=float)
            for rate in dict.fromkeys(picks):
                rows = rates[rate]
                base = _find(rows, f"vllm_baseline_{pattern}")
                fast = _find(rows, f"fastswitch_{pattern}")
                prefix = _find(rows, f"vllm_prefix_{pattern}")
                if not (base and fast):
                    continue
                v = ratios(base, fast)
                vp = ratios(prefix, fast) if prefix else None
                sens_cells = []
                for factor in ("x0.5", "x2"):
                    srows = part["sensitivity"].get(freq, {}).get(factor, {}).get(rate)
                    if srows and all("error" not in r for r in srows):
                        sv = ratios(srows[0], srows[1])
                        sens_cells.append(f"{_x(sv['ttft_p99'])}, {_x(sv['tbt_p999'])}")
                    else:
                        sens_cells.append("-")
                state = ("yes" if rate in fair else "**no**: collapsed" if not base["keeps_up"]
                         else "no: throughput lower")
                vs_prefix = f"{_x(vp['ttft_p99'])}, {_x(vp['tbt_p999'])}" if vp else "not shipped"
                lines.append(
                    f"| {pattern} {freq} | {rate} | {state} | {_x(v['ttft_p99'])} "
                    f"| {_x(v['tbt_p999'])} | {v['throughput']:.2f}x | {vs_prefix} "
                    f"| {' / '.join(sens_cells)} |")
    return lines


def targets(data: dict) -> list[str]:
    """The issue's targets next to what was measured."""
    lines = []
    fair_ok, fair_n, swap_lines, bpc = 0, 0, [], []
    for pattern, part in data["parts"].items():
        for freq, rates in part["sweep"].items():
            for rate in fair_loads(rates, pattern):
                rows = rates[rate]
                v = ratios(_find(rows, f"vllm_baseline_{pattern}"), _find(rows, f"fastswitch_{pattern}"))
                fair_n += 1
                fair_ok += v["ttft_p99"] >= 2 and v["tbt_p999"] >= 2
            for rate, rows in rates.items():
                g, r = _find(rows, f"groups_{pattern}"), _find(rows, f"reuse_{pattern}")
                nt = _find(rows, f"fastswitch_{pattern}_noturn")
                if g and r and g["swap"]["blocks_out"]:
                    gp = g["swap"]["preemption_blocks_out"]
                    swap_lines.append((pattern, freq, rate, r["swap"]["preemption_blocks_out"] / gp - 1
                                       if gp else 0.0, r["swap"]["blocks_out"] / g["swap"]["blocks_out"] - 1,
                                       nt["swap"]["blocks_out"] / g["swap"]["blocks_out"] - 1 if nt else None))
                if g and g["swap"]["copy_ops"]:
                    bpc.append(g["swap"]["blocks_per_copy"])
    lines.append(f"- **P99 TTFT and P99.9 TBT at least 2x better wherever the baseline keeps up**: "
                 f"met at {fair_ok} of {fair_n} (pattern, frequency, load) points where it keeps up "
                 "(queue not growing, throughput within 5% of FastSwitch's).")
    lines.append("- **Swap-out volume at least 40% lower with reuse (Table 1 counts swapped-out "
                 "blocks)**, reuse against groups (preemption copies only / all copies including "
                 "turn-end copies / FastSwitch with `turn_copies off`, all copies):")
    for pattern, freq, rate, pre, total, noturn in swap_lines:
        lines.append(f"  - {pattern} {freq}, {rate} conv/s: {pre:+.0%} / {total:+.0%} / "
                     f"{'-' if noturn is None else f'{noturn:+.0%}'}")
    if bpc:
        lines.append(f"- **Groups averaging at least 10 blocks per copy**: `groups_*` "
                     f"{min(bpc):.1f}-{max(bpc):.1f} blocks per copy call over every run that "
                     "swapped.")
    return lines


def markdown(data: dict) -> str:
    link = data["copy_link"]
    lines = ["# FastSwitch ladder, load sweep on the simulator", "",
             (f"Workload `{data['workload']},rate=R` (R conversations/s, ShareGPT lengths, contexts "
             f"to 8k); profile `{data['profile']}`: {data['profile_source']}"),
             (f"KV pool {data['num_blocks']} blocks of 16 tokens; host {data['config']['cpu_swap_blocks']} "
             f"blocks (60 GB); max_num_seqs {data['config']['max_num_seqs']}, max_batched_tokens "
             f"{data['config']['max_batched_tokens']}. Copy link: {link['dispatch_us']} us a call + "
             f"{link['bandwidth_gb_per_s']} GB/s ({link['source']})."),
             ("Ratios are against `vllm_baseline_*` at the same load in the same run (speed-ups: "
             "baseline / policy; throughput: policy / baseline). A run *keeps up* when its queue "
             "over the last third of the arrivals is at most 1.5x (+2) that over the first third."),
             "", "## Headline", ""] + headline(data) + ["", "## Targets", ""] + targets(data)
    for pattern, part in data["parts"].items():
        for freq, rates in part["sweep"].items():
            lines += ["", f"## {pattern}, priority-update frequency {freq}", ""]
            lines += sweep_table(rates, pattern)
    return "\n".join(lines)


def run_torch(setup: dict, out: Path) -> None:
    """The four ladder policies on the shipped model with real copies (CPU): copy calls and
    swap volume are real; latencies on a shared 2-core machine are noisy."""
    from policies import policy_path
    from shunter.benchmark.policies import parse_policy
    from shunter.benchmark.run import run_one
    from shunter.commands.bench import finite
    from shunter.workloads import load_workload

    w = load_workload(setup["workload"])
    rows = []
    for pattern in ("markov", "random"):
        for step in ("vllm_baseline", "groups", "reuse", "fastswitch"):
            c = attrs.evolve(parse_policy(str(policy_path(f"{step}_{pattern}"))), label=f"{step}_{pattern}")
            o = run_one(c, w, setup["config"], progress=False)
            m = o.metrics
            rows.append({"policy": c.label, "error": o.error} if m is None else {
                "policy": c.label, "ttft_p99_ms": m.ttft_ms.p99, "tbt_p999_ms": m.tbt_ms.p999,
                "output_tokens_per_s": m.output_tokens_per_s, "swap": m.as_dict()["swap"]})
    (out / "fastswitch_ladder_torch.json").write_text(json.dumps(finite(
        {"backend": "torch", "workload": setup["workload"], "rows": rows}), indent=1) + "\n")
