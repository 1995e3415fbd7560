"""FastSwitch's ablation ladder (FastSwitch §4, Fig. 8 and Table 1), measured with `shunter bench`.

For each priority-update pattern (Markov, Random) and frequency (0.04 = every 25 iterations,
0.02 = every 50), run the same multi-turn workload through the four policies of the ladder,
each one setting more than the last:

    vllm_baseline (per-block swap, sync swap-in, no reuse) -> groups -> reuse -> fastswitch

and report, against the baseline measured in the same run: copy calls per swapped block, swap-out
volume, P99 TTFT, P99.9 TBT and output throughput.

    python bench/fastswitch_ladder.py --backend sim      # Llama-3-8B profile, virtual time
    python bench/fastswitch_ladder.py --backend torch    # the shipped model, real copies on CPU

Results go to bench/results/fastswitch_ladder_<backend>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import attrs
import structlog

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from policies import policy_path  # noqa: E402
from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy  # noqa: E402
from shunter.benchmark.run import RunOutcome, run_all  # noqa: E402
from shunter.commands.bench import finite  # noqa: E402
from shunter.workloads import load_workload  # noqa: E402

LADDER = ("vllm_baseline", "groups", "reuse", "fastswitch")
PATTERNS = {"markov": "markov(stay = 0.8, seed = 7)", "random": "random(seed = 7)"}
FREQUENCIES = {0.04: 25, 0.02: 50}
"""Priority-update frequency (updates per iteration) -> iterations between updates."""

SETUPS = {
    # A10-sized KV pool for Llama-3-8B (FastSwitch §2.2 ran LLaMA-8B on an A10 24GB: ~4.5 GB of
    # KV after the weights, 16-token blocks of 2 MiB), and 40 GB of host swap space.
    "sim": dict(
        workload="multiturn:conversations=100,rate=0.25,seed=1",
        config=EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=1500,
                            cpu_swap_blocks=20000, max_num_seqs=64, max_batched_tokens=2048,
                            max_queued_requests=100_000)),
    # The shipped 2.4M-parameter model on this CPU: ShareGPT lengths scaled by 0.05 (contexts
    # up to ~400 tokens), a pool of 32 blocks of 16 tokens, real copies between two host
    # buffers in worker threads.
    "torch": dict(
        workload="multiturn:conversations=30,rate=3,think=1,seed=1,scale_lengths=0.05",
        config=EngineConfig(backend="torch", num_blocks=32, cpu_swap_blocks=1024, threads=2,
                            max_num_seqs=32, max_batched_tokens=256, max_queued_requests=100_000)),
}


def policy_files(folder: Path) -> dict[tuple[str, float], list[Path]]:
    """(pattern, frequency) -> the ladder's four policy files. Frequency 0.04 is the shipped
    files; 0.02 extends each with a slower update."""
    out: dict[tuple[str, float], list[Path]] = {}
    for pattern, rerank in PATTERNS.items():
        for freq, every in FREQUENCIES.items():
            paths = []
            for step in LADDER:
                shipped = policy_path(f"{step}_{pattern}")
                if every == 25:
                    paths.append(shipped)
                    continue
                path = folder / f"{step}_{pattern}_f{str(freq).replace('.', '')}.policy"
                path.write_text(f'policy {path.stem} extends "{shipped}" {{\n'
                                f"  every {every} iterations: rerank {rerank}\n}}\n")
                paths.append(path)
            out[(pattern, freq)] = paths
    return out


def preemption_bytes_out(s) -> float:
    """Bytes swapped out to preempt (not to keep an ended turn's KV for the next turn)."""
    if not s.blocks_out:
        return 0.0
    return s.bytes_out * (s.blocks_out - s.turn_end_blocks_out) / s.blocks_out


def summary(outcomes: list[RunOutcome]) -> list[dict]:
    base = outcomes[0].metrics
    rows = []
    for o in outcomes:
        m = o.metrics
        if m is None:
            rows.append({"policy": o.label, "error": o.error})
            continue
        s = m.swap
        per_block = s.copy_ops / (s.blocks_out + s.blocks_in) if s.blocks_out + s.blocks_in else 0.0
        base_per_block = base.swap.copy_ops / max(1, base.swap.blocks_out + base.swap.blocks_in)
        preempt_out = preemption_bytes_out(s)
        rows.append({
            "policy": o.label,
            "ttft_p99_ms": m.ttft_ms.p99, "tbt_p999_ms": m.tbt_ms.p999,
            "output_tokens_per_s": m.output_tokens_per_s,
            "copy_ops_per_swapped_block": per_block,
            "swap_out_gb": s.bytes_out / 1e9, "swap_in_gb": s.bytes_in / 1e9,
            "preemption_swap_out_gb": preempt_out / 1e9,
            "turn_end_swap_out_gb": (s.bytes_out - preempt_out) / 1e9,
            "stall_s": s.stall_s, "preemptions": m.preemptions,
            "completed": m.completed, "failed": m.failed,
            "vs_baseline": {
                "ttft_p99_speedup": base.ttft_ms.p99 / m.ttft_ms.p99,
                "tbt_p999_speedup": base.tbt_ms.p999 / m.tbt_ms.p999,
                "fewer_copy_calls_per_block": base_per_block / per_block if per_block else None,
                "swap_out_volume_change": s.bytes_out / base.swap.bytes_out - 1
                if base.swap.bytes_out else None,
                "preemption_swap_out_change": preempt_out / preemption_bytes_out(base.swap) - 1
                if base.swap.bytes_out else None,
                "throughput_ratio": m.output_tokens_per_s / base.output_tokens_per_s,
            },
        })
    return rows


def markdown(backend: str, workload: str, config: EngineConfig, results: dict) -> str:
    lines = [f"# FastSwitch ladder, {backend} backend", "",
             f"Workload `{workload}`; {config.num_blocks} device KV blocks, "
             f"{config.cpu_swap_blocks} host blocks"
             + (f"; profile {config.profile}" if backend == "sim" else "; shipped model") + ".",
             "Ratios are against `vllm_baseline_*` in the same run (speed-ups: baseline / policy).",
             ""]
    for key, rows in results.items():
        lines += [f"## {key}", "",
                  "| policy | P99 TTFT ms | P99.9 TBT ms | out tok/s | copies/block | swap-out GB "
                  "(preempt + turn end) | stall s | TTFT x | TBT x | fewer copies x "
                  "| preempt swap-out vs base | all swap-out vs base | tput x |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['policy']} | error: {r['error']} |")
                continue
            v = r["vs_baseline"]
            fewer = v["fewer_copy_calls_per_block"]
            lines.append(
                f"| {r['policy']} | {r['ttft_p99_ms']:.0f} | {r['tbt_p999_ms']:.0f} "
                f"| {r['output_tokens_per_s']:.1f} | {r['copy_ops_per_swapped_block']:.3g} "
                f"| {r['preemption_swap_out_gb']:.3g} + {r['turn_end_swap_out_gb']:.3g} "
                f"| {r['stall_s']:.2f} | {v['ttft_p99_speedup']:.2f} "
                f"| {v['tbt_p999_speedup']:.2f} | {'-' if fewer is None else f'{fewer:.3g}'} "
                f"| {v['preemption_swap_out_change']:+.0%} | {v['swap_out_volume_change']:+.0%} "
                f"| {v['throughput_ratio']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=tuple(SETUPS), default="sim")
    ap.add_argument("--workload", default=None, help="override the workload spec")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--name", default=None,
                    help="file name of the results (default fastswitch_ladder_BACKEND)")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    setup = SETUPS[args.backend]
    spec, config = args.workload or setup["workload"], setup["config"]
    workload = load_workload(spec)
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for (pattern, freq), paths in policy_files(Path(tmp)).items():
            key = f"{pattern}, priority-update frequency {freq}"
            choices = [attrs.evolve(parse_policy(str(p)), label=p.stem) for p in paths]
            outcomes = run_all(choices, workload, config, progress=False)
            results[key] = summary(outcomes)
            print(markdown(args.backend, spec, config, {key: results[key]}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (args.name or f"fastswitch_ladder_{args.backend}")
    stem.with_suffix(".json").write_text(json.dumps(finite(
        {"backend": args.backend, "workload": spec, "config": {
            k: str(getattr(config, k)) for k in ("num_blocks", "cpu_swap_blocks", "profile",
                                                  "max_num_seqs", "max_batched_tokens")},
         "results": results}), indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(args.backend, spec, config, results) + "\n")
    print(f"wrote {stem}.json and {stem}.md", file=sys.stderr)


if __name__ == "__main__":
    main()
