"""Automatic prefix caching on a multi-turn workload (issue 13, item 6), measured with
`shunter bench`'s runner: the same arrivals through each policy with the cache off and on, in
one run, plus FastSwitch against both vLLM baselines (as the paper ran it, and with prefix
caching).

    python bench/prefix_cache.py --backend sim      # Llama-3-8B profile, virtual time
    python bench/prefix_cache.py --backend torch    # the shipped model on this CPU

Pairs (cache off -> on): fcfs -> fcfs + `prefix_cache on`; vllm_baseline_* -> vllm_prefix_*
(Markov and Random priority updates every 25 iterations); fastswitch_* runs beside them (block
groups cannot share blocks, so it has no cache). Results: bench/results/prefix_cache_<backend>
.json and .md: token and block hit rates, TTFT p50/p99, P99.9 TBT, throughput, preemptions and
swap-out volume, with each cached run's ratios against its uncached pair.
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
from shunter import EngineConfig  # noqa: E402
from shunter.benchmark.policies import parse_policy  # noqa: E402
from shunter.benchmark.run import RunOutcome, run_all  # noqa: E402
from shunter.commands.bench import finite  # noqa: E402
from shunter.workloads import load_workload  # noqa: E402

SETUPS = {
    # the FastSwitch ladder's setting (bench/fastswitch_ladder.py): an A10-sized KV pool for
    # Llama-3-8B, 40 GB of host swap space; two loads of the same 100 conversations
    "sim": dict(
        workloads=["multiturn:conversations=100,rate=0.1,seed=1",
                   "multiturn:conversations=100,rate=0.25,seed=1"],
        config=EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=1500,
                            cpu_swap_blocks=20000, max_num_seqs=64, max_batched_tokens=2048,
                            max_queued_requests=100_000)),
    # the ladder's torch setting: the shipped model, ShareGPT lengths x0.05, 32 blocks of 16
    "torch": dict(
        workloads=["multiturn:conversations=30,rate=3,think=1,seed=1,scale_lengths=0.05"],
        config=EngineConfig(backend="torch", num_blocks=32, cpu_swap_blocks=1024, threads=2,
                            max_num_seqs=32, max_batched_tokens=256, max_queued_requests=100_000)),
}
PAIRS = [("fcfs", "fcfs_prefix"), ("vllm_baseline_markov", "vllm_prefix_markov"),
         ("vllm_baseline_random", "vllm_prefix_random")]
ALONE = ["fastswitch_markov", "fastswitch_random"]


def policy_paths(folder: Path) -> dict[str, Path]:
    fcfs_prefix = folder / "fcfs_prefix.policy"
    fcfs_prefix.write_text(f'policy fcfs_prefix extends "{policy_path("fcfs")}" {{\n'
                           "  memory { prefix_cache on }\n}\n")
    names = [n for pair in PAIRS for n in pair] + ALONE
    return {n: fcfs_prefix if n == "fcfs_prefix" else policy_path(n) for n in names}


def row(o: RunOutcome) -> dict:
    m = o.metrics
    if m is None:
        return {"policy": o.label, "error": o.error}
    c = m.prefix_cache.as_dict()
    return {"policy": o.label, "token_hit_rate": c["token_hit_rate"],
            "block_hit_rate": c["block_hit_rate"], "hit_tokens": c["hit_tokens"],
            "queried_tokens": c["queried_tokens"], "evicted_blocks": c["evicted_blocks"],
            "ttft_p50_ms": m.ttft_ms.p50, "ttft_p99_ms": m.ttft_ms.p99,
            "tbt_p999_ms": m.tbt_ms.p999, "output_tokens_per_s": m.output_tokens_per_s,
            "preemptions": m.preemptions, "swap_out_gb": m.swap.bytes_out / 1e9,
            "completed": m.completed, "failed": m.failed, "wall_s": o.wall_s}


def with_ratios(rows: dict[str, dict]) -> None:
    """Each cached run against its uncached pair (speed-ups: uncached / cached)."""
    for off, on in PAIRS:
        a, b = rows.get(off), rows.get(on)
        if a is None or b is None or "error" in a or "error" in b:
            continue
        b["vs_" + off] = {
            "ttft_p50_speedup": a["ttft_p50_ms"] / b["ttft_p50_ms"],
            "ttft_p99_speedup": a["ttft_p99_ms"] / b["ttft_p99_ms"],
            "tbt_p999_speedup": a["tbt_p999_ms"] / b["tbt_p999_ms"],
            "throughput_ratio": b["output_tokens_per_s"] / a["output_tokens_per_s"]}
    for name in ALONE:
        f = rows.get(name)
        if f is None or "error" in f:
            continue
        pattern = name.rsplit("_", 1)[1]
        for base in (f"vllm_baseline_{pattern}", f"vllm_prefix_{pattern}"):
            b = rows.get(base)
            if b is not None and "error" not in b:
                f["vs_" + base] = {"ttft_p99_speedup": b["ttft_p99_ms"] / f["ttft_p99_ms"],
                                   "tbt_p999_speedup": b["tbt_p999_ms"] / f["tbt_p999_ms"],
                                   "throughput_ratio": f["output_tokens_per_s"]
                                   / b["output_tokens_per_s"]}


def markdown(backend: str, config: EngineConfig, results: dict[str, dict[str, dict]]) -> str:
    lines = [f"# Prefix caching, {backend} backend", "",
             f"{config.num_blocks} device KV blocks of {config.block_size} tokens, "
             f"{config.cpu_swap_blocks} host blocks"
             + (f"; profile {config.profile}" if backend == "sim" else "; shipped model")
             + ". Ratios: the uncached run / the cached one (throughput: cached / uncached); "
               "FastSwitch's against each vLLM baseline.", ""]
    for spec, rows in results.items():
        lines += [f"## `{spec}`", "",
                  "| policy | token hits | block hits | evicted | TTFT p50 ms | TTFT p99 ms "
                  "| P99.9 TBT ms | out tok/s | preempt | swap-out GB | ratios |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows.values():
            if "error" in r:
                lines.append(f"| {r['policy']} | error: {r['error']} |")
                continue
            ratios = "; ".join(
                f"vs {k[3:]}: " + ", ".join(f"{n.replace('_speedup', '').replace('_', ' ')} "
                                            f"{v:.2f}x" for n, v in d.items())
                for k, d in r.items() if k.startswith("vs_"))
            lines.append(
                f"| {r['policy']} | {100 * r['token_hit_rate']:.1f}% | "
                f"{100 * r['block_hit_rate']:.1f}% | {r['evicted_blocks']} "
                f"| {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tbt_p999_ms']:.0f} "
                f"| {r['output_tokens_per_s']:.1f} | {r['preemptions']} "
                f"| {r['swap_out_gb']:.3g} | {ratios or '-'} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=tuple(SETUPS), default="sim")
    ap.add_argument("--workload", action="append", help="override the workload specs")
    ap.add_argument("--only", action="append", help="run only these policies")
    ap.add_argument("--num-blocks", type=int, default=None, help="override the device pool")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--name", default=None, help="results file name (default prefix_cache_BACKEND)")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    setup = SETUPS[args.backend]
    config = setup["config"]
    if args.num_blocks:
        config = attrs.evolve(config, num_blocks=args.num_blocks)
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = policy_paths(Path(tmp))
        names = [n for n in paths if not args.only or n in args.only]
        choices = [attrs.evolve(parse_policy(str(paths[n])), label=n) for n in names]
        for spec in args.workload or setup["workloads"]:
            outcomes = run_all(choices, load_workload(spec), config, progress=False)
            rows = {o.label: row(o) for o in outcomes}
            with_ratios(rows)
            results[spec] = rows
            print(markdown(args.backend, config, {spec: rows}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (args.name or f"prefix_cache_{args.backend}")
    stem.with_suffix(".json").write_text(json.dumps(finite(
        {"backend": args.backend, "config": {
            k: str(getattr(config, k)) for k in ("num_blocks", "block_size", "cpu_swap_blocks",
                                                  "profile", "max_num_seqs", "max_batched_tokens")},
         "results": results}), indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(args.backend, config, results) + "\n")
    print(f"wrote {stem}.json and {stem}.md", file=sys.stderr)


if __name__ == "__main__":
    main()
