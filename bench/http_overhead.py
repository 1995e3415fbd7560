"""What the HTTP layer costs: the same workload (same prompts, same max_tokens, the shipped model
on the torch backend) run in-process through `engine.generate` and then through `shunter serve`'s
app over loopback SSE, against the same engine in one run. Prints output tokens/s for each and
their ratio, and p50 TTFT for each and the p50 the HTTP layer adds.

    python bench/http_overhead.py [--requests 16] [--max-tokens 64] [--rounds 2]
                                  [--async-backend asyncio|trio] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shunter import Engine, EngineConfig, SamplingParams  # noqa: E402
from shunter.server import build_app  # noqa: E402
from shunter.server.serve import serve_app  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\n\ndef walk(path):", "class Stack:",
           "def parse_args(argv):", "# read a csv file\nimport csv\n", "def quicksort(xs):",
           "with open(path) as f:", "for i, line in enumerate(lines):"]


def prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + f"  # {i}" for i in range(n)]


async def in_process(engine: Engine, texts: list[str], max_tokens: int) -> tuple[list, int, float]:
    ttfts, tokens = [], 0

    async def one(text: str) -> None:
        nonlocal tokens
        start, first = time.perf_counter(), None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for chunk in engine.generate(text, params):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - start
            tokens += len(chunk.token_ids)
        ttfts.append(first)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for text in texts:
            tg.start_soon(one, text)
    return ttfts, tokens, time.perf_counter() - start


async def over_http(url: str, texts: list[str], max_tokens: int) -> tuple[list, int, float]:
    ttfts, tokens = [], 0
    limits = httpx.Limits(max_connections=len(texts) + 4)

    async def one(http: httpx.AsyncClient, text: str) -> None:
        nonlocal tokens
        body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        start, first = time.perf_counter(), None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event["choices"] and first is None:
                    first = time.perf_counter() - start
                if event.get("usage"):
                    tokens += event["usage"]["completion_tokens"]
        ttfts.append(first)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as http:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for text in texts:
                tg.start_soon(one, http, text)
        return ttfts, tokens, time.perf_counter() - start


async def main(args: argparse.Namespace) -> dict:
    texts = prompts(args.requests)
    config = EngineConfig(max_num_seqs=max(64, args.requests))
    async with Engine.start(config) as engine:
        app = build_app(engine)
        done = anyio.Event()
        async with anyio.create_task_group() as tg:
            url = await tg.start(lambda task_status: serve_app(
                app, shutdown_trigger=done.wait, task_status=task_status))
            await in_process(engine, texts[:2], 4)  # warm-up, both paths
            await over_http(url, texts[:2], 4)
            runs: dict[str, list] = {"in_process": [], "http": []}
            for _ in range(args.rounds):  # interleaved, so drift hits both alike
                runs["in_process"].append(await in_process(engine, texts, args.max_tokens))
                runs["http"].append(await over_http(url, texts, args.max_tokens))
            done.set()
    out: dict = {"requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
                 "async_backend": args.async_backend, "model": str(config.model.name)}
    for name, results in runs.items():
        ttfts = [t for r in results for t in r[0]]
        out[name] = {"output_tokens_per_s": sum(r[1] for r in results) / sum(r[2] for r in results),
                     "p50_ttft_ms": 1000 * statistics.median(ttfts)}
    http, inproc = out["http"], out["in_process"]
    out["throughput_ratio"] = http["output_tokens_per_s"] / inproc["output_tokens_per_s"]
    out["p50_ttft_added_ms"] = http["p50_ttft_ms"] - inproc["p50_ttft_ms"]
    out["p50_ttft_ratio"] = http["p50_ttft_ms"] / inproc["p50_ttft_ms"]
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--async-backend", default="asyncio", choices=("asyncio", "trio"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = anyio.run(main, args, backend=args.async_backend)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
