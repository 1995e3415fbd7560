"""How much one other busy process slows generation, for each thread setting, in one run.

Each cell serves the same workload (--model, default the shipped one; --requests concurrent
greedy requests of --max-tokens tokens each) in a fresh process of its own, quiet and then with
one competing process spinning on a core, and reports output tokens/s. Cells are interleaved
round by round so that slow drift of the machine hits every setting alike. Prints one JSON
object; --out writes it.

    python bench/contention.py [--rounds 3] [--requests 32] [--max-tokens 128] [--model DIR]

Settings: the engine's default (no --threads: the runner picks the count from its own step
times, gpu/thread_tuner.py), the count fixed at one per core (the default before the tuner:
torch's own choice), one thread (`--threads 1`), and one per core with OMP_WAIT_POLICY=PASSIVE
(threads sleep at barriers at once); `--try VAR=VALUE,...` adds one at one per core. Ratios are
against the fixed one-per-core quiet speed ("today's speed" of the robustness issue).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CORES = os.cpu_count() or 1
SETTINGS = {
    f"threads={CORES} (fixed)": ({}, CORES),
    "default (tuned)": ({}, None),
    "threads=1": ({}, 1),
    f"threads={CORES}, OMP_WAIT_POLICY=PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, CORES),
}
BASELINE = next(iter(SETTINGS))

CHILD = """
import sys, time, json, anyio
sys.path.insert(0, {root!r})
from shunter import Engine, EngineConfig, SamplingParams

async def main():
    model = {model!r}
    config = EngineConfig(threads={threads!r}, **({{}} if model is None else {{"model": model}}))
    async with Engine.start(config) as engine:
        params = SamplingParams(max_tokens={max_tokens}, ignore_eos=True)
        await engine.complete([5, 6, 7], SamplingParams(max_tokens=4))  # warm-up
        tokens = 0
        began = time.perf_counter()
        async def one(i):
            nonlocal tokens
            done = await engine.complete([(i * 7 + k) % 300 + 3 for k in range(24)], params)
            tokens += len(done.token_ids)
        async with anyio.create_task_group() as tg:
            for i in range({requests}):
                tg.start_soon(one, i)
        rate = tokens / (time.perf_counter() - began)
        tuner = engine.backend.runner.thread_tuner
        switches = [] if tuner is None else [[w.step, w.before, w.after, round(w.ratio, 3)]
                                             for w in tuner.switches]
        print(json.dumps({{"tokens_per_s": rate, "switches": switches}}))

anyio.run(main)
"""


def run_cell(env_extra: dict[str, str], threads: int | None, busy: bool, args) -> dict:
    model = None if args.model is None else str(args.model)
    code = CHILD.format(root=str(ROOT), threads=threads, max_tokens=args.max_tokens,
                        requests=args.requests, model=model)
    competitor = None
    if busy:
        competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
    try:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env_extra},
                             capture_output=True, text=True, check=True, timeout=600)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", type=Path, default=None, help="model directory (default: shipped)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--try", dest="extra", action="append", default=[], metavar="VAR=VALUE,...",
                   help="one more setting: environment variables for the default thread count")
    p.add_argument("--only", default=None, metavar="PREFIX,...",
                   help="run only the settings whose names start with one of these")
    args = p.parse_args()
    load_at_start = os.getloadavg()
    if args.only:
        keep = tuple(args.only.split(","))
        for name in [n for n in SETTINGS if not n.startswith(keep) and n != BASELINE]:
            del SETTINGS[name]
    for spec in args.extra:
        SETTINGS[spec] = (dict(kv.split("=", 1) for kv in spec.split(",")), CORES)
    cells: dict[str, dict[str, list[float]]] = {
        name: {"quiet": [], "busy": []} for name in SETTINGS}
    switches: dict[str, dict[str, list]] = {name: {"quiet": [], "busy": []} for name in SETTINGS}
    for _ in range(args.rounds):
        for name, (env_extra, threads) in SETTINGS.items():
            for busy in (False, True):
                cell = run_cell(env_extra, threads, busy, args)
                tps = cell["tokens_per_s"]
                cells[name]["busy" if busy else "quiet"].append(tps)
                switches[name]["busy" if busy else "quiet"].append(cell["switches"])
                print(f"{name:45s} {'busy' if busy else 'quiet'}: {tps:8.1f} tok/s", file=sys.stderr)
    base = statistics.median(cells[BASELINE]["quiet"])
    result = {"requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "model": str(args.model or "shipped"), "cpus": CORES,
              "load_average_at_start": load_at_start, "settings": {}}
    for name, c in cells.items():
        quiet, busy = statistics.median(c["quiet"]), statistics.median(c["busy"])
        result["settings"][name] = {
            "quiet_tokens_per_s": quiet, "busy_tokens_per_s": busy,
            "slowdown_with_competitor": quiet / busy,
            "quiet_vs_fixed_quiet": quiet / base, "runs": c,
            "tuner_switches": switches[name]}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
