"""FastSwitch's ablation ladder (FastSwitch §4, Fig. 8 and Table 1) as a load sweep, measured with
the engine's own actors on the simulator (issue 13).

For each priority-update pattern (Markov, Random) and frequency (0.04 = every 25 iterations,
0.02 = every 50), the same multi-turn ShareGPT workload at each load (conversations/s), through

    vllm_baseline (per-block swap, sync swap-in, no reuse) -> groups -> reuse -> fastswitch
    + vllm_prefix (the baseline with vLLM's automatic prefix caching, when policies/ has it)
    + fastswitch with `turn_copies off` (KV reuse for preemptions only, item 7)

on the A10 profile (sim/profiles/llama3-8b-a10.json: the paper's GPU; KV pool 24 GB minus weights
and activations; 60 GB of host swap space as in §4; copy costs from FastSwitch §2.2). Then the
baseline and FastSwitch again at two loads with the per-call copy cost halved and doubled.

    python bench/fastswitch_ladder.py --pattern markov --part   # one pattern per process
    python bench/fastswitch_ladder.py --pattern random --part
    python bench/fastswitch_ladder.py --report                  # merge into .json and .md
    python bench/fastswitch_ladder.py --knee                    # 0.1 conv/s, cheaper copies

    python bench/fastswitch_ladder.py --backend torch           # the shipped model, real copies

Results: bench/results/fastswitch_ladder_sim.{json,md} (fastswitch_ladder_torch.* for torch).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import attrs
import structlog

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from policies import policy_path
from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import RunOutcome, run_one
from shunter.benchmark.sweep import keeps_up, queue_trend
from shunter.commands.bench import finite
from shunter.workloads import load_workload
from sim.copy_costs import scaled
from sim.profile import load_profile, save_profile

LADDER = ("vllm_baseline", "groups", "reuse", "fastswitch")
PATTERNS = {"markov": "markov(stay = 0.8, seed = 7)", "random": "random(seed = 7)"}
FREQUENCIES = {0.04: 25, 0.02: 50}
"""Priority-update frequency (updates per iteration) -> iterations between updates."""
RATES = ("0.05", "0.1", "0.2", "0.4")
"""Conversations/s. This workload averages 2.5 turns a conversation (contexts end at 8k tokens),
so 0.4 is about FastSwitch's 1 request/s (§4)."""
SENSITIVITY_RATES = ["0.05", "0.4"]
DISPATCH_FACTORS = (0.5, 2.0)
RESULTS = ROOT / "bench" / "results"

SIM = {
    "workload": "multiturn:conversations=50,seed=1",
    "profile": "llama3-8b-a10",
    # 60 GB of host swap space (FastSwitch §4) in 2 MiB blocks (Llama-3-8B, 16 tokens)
    "config": EngineConfig(backend="sim", profile="llama3-8b-a10", cpu_swap_blocks=28610,
                        max_num_seqs=64, max_batched_tokens=2048, max_queued_requests=100_000)}
TORCH = {
    # the shipped 2.4M-parameter model on this CPU: ShareGPT lengths x0.05, 32 device blocks
    "workload": "multiturn:conversations=30,rate=3,think=1,seed=1,scale_lengths=0.05",
    "config": EngineConfig(backend="torch", num_blocks=32, cpu_swap_blocks=1024, threads=2,
                        max_num_seqs=32, max_batched_tokens=256, max_queued_requests=100_000)}


def policy_files(folder: Path, pattern: str, freq: float) -> list[Path]:
    """The ladder, the prefix-caching baseline (if shipped) and FastSwitch without turn-end
    copies, at this update frequency."""
    every = FREQUENCIES[freq]
    names = [f"{step}_{pattern}" for step in LADDER]
    if (ROOT / "policies" / f"vllm_prefix_{pattern}.policy").is_file():
        names.insert(1, f"vllm_prefix_{pattern}")
    paths = []
    for name in names:
        shipped = policy_path(name)
        if every == 25:
            paths.append(shipped)
            continue
        path = folder / f"{name}_f{every}.policy"
        path.write_text(f'policy {path.stem} extends "{shipped}" {{\n'
                        f"  every {every} iterations: rerank {PATTERNS[pattern]}\n}}\n")
        paths.append(path)
    fast = paths[-1]
    path = folder / f"fastswitch_{pattern}_noturn_f{every}.policy"
    path.write_text(f'policy {path.stem} extends "{fast}" {{\n  memory {{ turn_copies off }}\n}}\n')
    paths.append(path)
    return paths


def label(path: Path) -> str:
    return path.stem.removesuffix("_f25").removesuffix("_f50")


def row(o: RunOutcome, workload, layers: int) -> dict:
    m = o.metrics
    if m is None:
        return {"policy": o.label, "error": o.error}
    s = m.swap
    blocks = s.blocks_out + s.blocks_in
    first, last = queue_trend(o, workload)
    preempt_out = s.blocks_out - s.turn_end_blocks_out
    return {
        "policy": o.label, "ttft_p99_ms": m.ttft_ms.p99, "ttft_p95_ms": m.ttft_ms.p95,
        "tbt_p999_ms": m.tbt_ms.p999, "output_tokens_per_s": m.output_tokens_per_s,
        "queued_first_third": first, "queued_last_third": last, "keeps_up": keeps_up(first, last),
        "duration_s": m.duration_s, "completed": m.completed, "failed": m.failed,
        "preemptions": m.preemptions, "wall_s": o.wall_s,
        "swap": {
            "blocks_out": s.blocks_out, "preemption_blocks_out": preempt_out,
            "turn_end_blocks_out": s.turn_end_blocks_out, "blocks_in": s.blocks_in,
            "reused_blocks": s.reused_blocks, "turn_prefix_blocks": s.turn_prefix_blocks,
            "copy_ops": s.copy_ops, "runs": s.runs,
            "blocks_per_copy": blocks / s.copy_ops if s.copy_ops else 0.0,
            # item 10: copy calls per swapped block, three ways
            "calls_per_block_per_block_layout": 2 * layers,
            "calls_per_block_paper_groups": 2 * layers * s.runs / blocks if blocks else 0.0,
            "calls_per_block_ours": s.copy_ops / blocks if blocks else 0.0,
            "stall_s": s.stall_s, "step_copy_wait_s": s.step_copy_wait_s, "yields": s.yields,
            "sync_swap_ins": s.sync_swap_ins, "async_swap_ins": s.async_swap_ins}}


def run_part(pattern: str, rates: list[str], out: Path, folder: Path) -> None:
    spec, config = SIM["workload"], SIM["config"]
    layers = load_profile(SIM["profile"]).model.num_layers
    part: dict = {"pattern": pattern, "sweep": {}, "sensitivity": {}}
    for freq in FREQUENCIES:
        choices = [attrs.evolve(parse_policy(str(p)), label=label(p))
                   for p in policy_files(folder, pattern, freq)]
        for rate in rates:
            w = load_workload(f"{spec},rate={rate}")
            rows = []
            for c in choices:
                began = time.time()
                rows.append(row(run_one(c, w, config, progress=False), w, layers))
                print(f"{pattern} {freq} rate {rate} {c.label}: {time.time() - began:.0f}s "
                      f"ttft99 {rows[-1].get('ttft_p99_ms', 0):.0f}", file=sys.stderr, flush=True)
            part["sweep"].setdefault(str(freq), {})[rate] = rows
        base_fast = [choices[0], choices[-2]]
        for factor in DISPATCH_FACTORS:
            prof = load_profile(SIM["profile"])
            path = folder / f"a10_dispatch_x{factor:g}.json"
            save_profile(attrs.evolve(prof, link=scaled(prof.link, factor)), path)
            cfg = attrs.evolve(config, profile=str(path))
            for rate in SENSITIVITY_RATES:
                w = load_workload(f"{spec},rate={rate}")
                rows = [row(run_one(c, w, cfg, progress=False), w, layers) for c in base_fast]
                part["sensitivity"].setdefault(str(freq), {}).setdefault(
                    f"x{factor:g}", {})[rate] = rows
                print(f"{pattern} {freq} x{factor:g} rate {rate} done", file=sys.stderr, flush=True)
    out.write_text(json.dumps(finite(part), indent=1) + "\n")


def run_knee(out: Path, folder: Path) -> None:
    """Markov 0.04 at 0.1 conv/s (the first load that preempts) with the per-call cost halved and
    at 2 us a call (FastSwitch Table 1 read as whole blocks): does the baseline keep up then?"""
    layers = load_profile(SIM["profile"]).model.num_layers
    w = load_workload(f"{SIM['workload']},rate=0.1")
    results = {}
    for factor in (0.5, 2.0 / load_profile(SIM["profile"]).link.dispatch_us):
        prof = load_profile(SIM["profile"])
        path = folder / f"a10_x{factor:.4f}.json"
        save_profile(attrs.evolve(prof, link=scaled(prof.link, factor)), path)
        cfg = attrs.evolve(SIM["config"], profile=str(path))
        for name in ("vllm_baseline_markov", "fastswitch_markov"):
            results[f"{name} x{factor:.4f}"] = row(run_one(parse_policy(name), w, cfg,
                                                           progress=False), w, layers)
    out.write_text(json.dumps(finite(results), indent=1) + "\n")


def merge(parts: list[dict]) -> dict:
    """One pattern's part files as one, loads in increasing order."""
    out: dict = {"pattern": parts[0]["pattern"], "sweep": {}, "sensitivity": {}}
    for part in parts:
        for section in ("sweep", "sensitivity"):
            for freq, by in part[section].items():
                into = out[section].setdefault(freq, {})
                for k, v in by.items():
                    if isinstance(v, dict):
                        into.setdefault(k, {}).update(v)
                    else:
                        into[k] = v
    for freq, rates in out["sweep"].items():
        out["sweep"][freq] = dict(sorted(rates.items(), key=lambda kv: float(kv[0])))
    return out


def ratios(base: dict, other: dict) -> dict:
    return {"ttft_p99": base["ttft_p99_ms"] / other["ttft_p99_ms"],
            "tbt_p999": base["tbt_p999_ms"] / other["tbt_p999_ms"],
            "throughput": other["output_tokens_per_s"] / base["output_tokens_per_s"]}


def report(parts: list[dict]) -> tuple[dict, str]:
    from bench.fastswitch_report import markdown

    data = {"backend": "sim", "workload": SIM["workload"], "profile": SIM["profile"],
            "config": {k: str(getattr(SIM["config"], k)) for k in
                       ("cpu_swap_blocks", "max_num_seqs", "max_batched_tokens")},
            "profile_source": load_profile(SIM["profile"]).source,
            "copy_link": attrs.asdict(load_profile(SIM["profile"]).link),
            "num_blocks": load_profile(SIM["profile"]).num_blocks(16),
            "parts": {p["pattern"]: p for p in parts}}
    return data, markdown(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("sim", "torch"), default="sim")
    ap.add_argument("--pattern", choices=tuple(PATTERNS), default=None)
    ap.add_argument("--part", action="store_true", help="run one pattern's sweep to a part file")
    ap.add_argument("--report", action="store_true", help="merge the part files")
    ap.add_argument("--rates", default=",".join(RATES))
    ap.add_argument("--workload", default=None, help="override the workload spec (no rate)")
    ap.add_argument("--tag", default="", help="part file suffix (more loads for one pattern)")
    ap.add_argument("--no-sensitivity", action="store_true")
    ap.add_argument("--knee", action="store_true",
                    help="the baseline at 0.1 conv/s with cheaper copies (x0.5, 2 us a call)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.backend == "torch":
        from bench.fastswitch_report import run_torch
        run_torch(TORCH, args.out)
        return
    if args.workload:
        SIM["workload"] = args.workload
    if args.knee:
        with tempfile.TemporaryDirectory() as tmp:
            run_knee(args.out / "fastswitch_knee_sensitivity.json", Path(tmp))
        return
    if args.part:
        with tempfile.TemporaryDirectory() as tmp:
            out = args.out / f"fastswitch_ladder_sim_{args.pattern}{args.tag}.part.json"
            if args.no_sensitivity:
                SENSITIVITY_RATES.clear()
            run_part(args.pattern, args.rates.split(","), out, Path(tmp))
        return
    parts = []
    for pattern in PATTERNS:
        files = sorted(args.out.glob(f"fastswitch_ladder_sim_{pattern}*.part.json"))
        if files:
            parts.append(merge([json.loads(f.read_text()) for f in files]))
    data, md = report(parts)
    (args.out / "fastswitch_ladder_sim.json").write_text(json.dumps(finite(data), indent=1) + "\n")
    (args.out / "fastswitch_ladder_sim.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
