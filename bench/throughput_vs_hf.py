"""Output tokens/s of the engine against transformers' generate() in padded batches of 8.

Same model, same threads, the same 64 prompts of mixed lengths, greedy. By default every prompt
asks for exactly --max-tokens new tokens on both sides. With --mixed-outputs each prompt asks for
its own number (uniform in 8..2 x --max-tokens - 8, seeded), as real requests do; transformers
then runs each padded batch until its longest request is done, and only the tokens each request
asked for are counted on both sides. Each side runs --repeats times in a fresh process of its
own and its median run counts. Prints one JSON object; --out also writes it to a file.

    python bench/throughput_vs_hf.py [--model DIR] [--threads 2] [--max-tokens 64] [--mixed-outputs]
                                     [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import default_model_dir
from shunter import Engine, EngineConfig, SamplingParams
from shunter.backends import build_backend  # noqa: E402


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 200))] for _ in range(n)]


def output_lengths(n: int, max_tokens: int, mixed: bool, seed: int) -> list[int]:
    if not mixed:
        return [max_tokens] * n
    rng = random.Random(seed + 1)
    return [rng.randint(8, 2 * max_tokens - 8) for _ in range(n)]


def run_hf(model_dir: Path, prompts: list[list[int]], lengths: list[int], batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    began = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group, new = prompts[i:i + batch], max(lengths[i:i + batch])
            width = max(len(p) for p in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                           min_new_tokens=new, pad_token_id=0)
    return time.perf_counter() - began


async def run_engine(model_dir: Path, prompts: list[list[int]], lengths: list[int],
                     threads: int) -> tuple[float, dict]:
    config = EngineConfig(model=model_dir, threads=threads, max_num_seqs=64, max_batched_tokens=512)
    backend = build_backend(config)
    steps = backend.runner.record_steps()  # each step itself, on the device thread
    async with Engine.start(config, backend=backend) as engine:
        steps.clear()  # start-up work is not the workload's
        began = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p, n in zip(prompts, lengths):
                tg.start_soon(engine.complete, p, SamplingParams(max_tokens=n, ignore_eos=True))
        wall = time.perf_counter() - began
        snap = await engine.inspect()
    iterations = snap.scheduler.iteration
    step_s = [end - began for _, began, end in steps]
    # what an iteration costs beyond its step: scheduling, the messages, the hop to the device
    # thread and back, streaming the outputs
    overhead_ms = (wall - sum(step_s)) / max(iterations, 1) * 1000.0
    return wall, {"iterations": iterations, "step_s": sum(step_s),
                  "overhead_ms_per_iteration": overhead_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=default_model_dir())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--mixed-outputs", action="store_true",
                    help="each prompt asks for its own number of new tokens")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each side; the median is reported")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--side", choices=("engine", "hf"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        print(json.dumps(run_side(args)))
        return
    # each side in a fresh process: neither inherits the other's threads, allocator state or
    # OpenMP pools (a second pool halves torch's CPU speed: gpu/device_thread.py)
    sides = {side: measure_side(side, sys.argv[1:]) for side in ("engine", "hf")}
    tokens = sides["engine"]["output_tokens"]
    engine_s, hf_s = sides["engine"]["median_s"], sides["hf"]["median_s"]
    result = {
        "model": str(args.model), "threads": args.threads, "prompts": args.prompts,
        "max_tokens": args.max_tokens, "mixed_outputs": args.mixed_outputs,
        "output_tokens": tokens, "repeats": args.repeats,
        "engine_tokens_per_s": tokens / engine_s, "hf_tokens_per_s": tokens / hf_s,
        "speedup": hf_s / engine_s, "engine_iterations": sides["engine"]["iterations"],
        "engine_overhead_ms_per_iteration": sides["engine"]["overhead_ms_per_iteration"],
        "engine_step_ms_per_iteration":
            sides["engine"]["step_s"] / sides["engine"]["iterations"] * 1000.0,
        "engine_runs_s": sides["engine"]["runs_s"], "hf_runs_s": sides["hf"]["runs_s"],
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def run_side(args: argparse.Namespace) -> dict:
    """One side's runs, in this process."""
    torch.set_num_threads(args.threads)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.prompts, vocab, seed=0)
    lengths = output_lengths(args.prompts, args.max_tokens, args.mixed_outputs, seed=0)
    runs: list[tuple[float, dict]] = []
    for _ in range(args.repeats):
        if args.side == "engine":
            runs.append(anyio.run(run_engine, args.model, prompts, lengths, args.threads))
        else:
            runs.append((run_hf(args.model, prompts, lengths, args.hf_batch), {}))
    median_s, info = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    return {"runs_s": [s for s, _ in runs], "median_s": median_s,
            "output_tokens": sum(lengths), **info}


def measure_side(side: str, argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, *argv, "--side", side],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {side} side failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
