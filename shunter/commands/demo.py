"""`shunter demo`: the main job. Serve the shipped model to a short concurrent workload, show the
tokens streaming in, and summarise latency and throughput."""

from __future__ import annotations

import argparse
import random
import sys
import time

import anyio

from engine.params import SamplingParams
from shunter.commands.cluster_options import (
    add_cluster_options,
    cluster_fields,
    preemptions,
    start_engine,
)
from shunter.commands.common import add_engine_options, engine_config
from shunter.engine import Engine

PROMPTS = (
    "def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self", "for i in range(",
    "if __name__ == '__main__':", "with open(filename) as f:", "try:\n    import ",
    "raise ValueError(", "from collections import ", "def __repr__(self):", "return self.",
    "    def read(self, size=-1):",
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="serve the shipped model to a short concurrent workload",
                       description=__doc__)
    p.add_argument("--requests", type=int, default=12, help="how many requests")
    p.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    add_engine_options(p)
    add_cluster_options(p)
    p.set_defaults(run=run)


class Panel:
    """One line per request, redrawn in place on a terminal; plain lines otherwise."""

    def __init__(self, n: int, live: bool) -> None:
        self.lines = [""] * n
        self.live = live
        self.width = 100
        if live:
            sys.stdout.write("\n" * n)

    def update(self, i: int, text: str) -> None:
        self.lines[i] = text
        if self.live:
            up = len(self.lines) - i
            shown = text.replace("\n", "⏎")[-self.width:]
            sys.stdout.write(f"\x1b[{up}A\r\x1b[2K[{i:2d}] {shown}\x1b[{up}B\r")
            sys.stdout.flush()

    def done(self, i: int, reason: str) -> None:
        if not self.live:
            print(f"[{i:2d}] ({reason}) {self.lines[i]!r}")


async def serve(args: argparse.Namespace) -> None:
    from engine.metrics import summarize  # numpy: only once the demo runs

    rng = random.Random(args.seed)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    panel = Panel(len(prompts), live=sys.stdout.isatty())
    timelines = []
    params = SamplingParams(max_tokens=args.max_tokens)

    async def client(engine: Engine, i: int, delay: float) -> None:
        await anyio.sleep(delay)
        text = prompts[i]
        async for chunk in engine.generate(prompts[i], params):
            text += chunk.text
            panel.update(i, text)
            if chunk.finish_reason:
                panel.done(i, chunk.finish_reason)
                timelines.append(chunk.timeline)

    began = time.perf_counter()
    async with start_engine(engine_config(args, **cluster_fields(args)), args) as engine:
        t = 0.0
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(client, engine, i, t)
                t += rng.expovariate(args.rate)
        snap = await engine.inspect()
    wall = time.perf_counter() - began
    s = summarize(timelines, duration_s=wall)
    print(f"\n{len(timelines)} requests, {s.output_tokens} tokens in {wall:.1f} s "
          f"({s.output_tokens / wall:.1f} tokens/s); TTFT p50 {s.ttft_ms.p50:.0f} ms, "
          f"p99 {s.ttft_ms.p99:.0f} ms; TPOT p50 {s.tpot_ms.p50:.1f} ms; "
          f"preemptions {preemptions(snap)}")


def run(args: argparse.Namespace) -> int:
    anyio.run(serve, args, backend=args.async_backend)
    return 0
