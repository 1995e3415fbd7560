"""`shunter generate`: run prompts through the engine, all at once, and print the results."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import anyio

from engine.config import EngineConfig
from engine.errors import AdmissionError, InvalidRequestError, ShunterError
from engine.params import SamplingParams
from engine.snapshots import EngineSnapshot
from shunter.commands.cluster_options import add_cluster_options, cluster_fields, start_engine
from shunter.commands.common import add_engine_options, engine_config
from shunter.commands.prompts_file import PromptLine, prompt_from_option, read_prompts
from shunter.engine import Engine


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt or a file of prompts",
                       description="Submit every prompt at once (they are served concurrently) "
                                   "and print each result, in input order.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-file", type=Path,
                     help='JSONL: one {"prompt": "..."} or {"prompt_ids": [...]} a line, each '
                          "optionally with its own max_tokens, temperature, priority, "
                          "request_class, tenant and conversation_id")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="most tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the likeliest tokens holding this probability mass")
    p.add_argument("--seed", type=int, default=None, help="per-request seed (request i gets seed+i)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--json", action="store_true",
                   help='print {"index", "token_ids", "text", "finish_reason"} per prompt, one a line')
    add_engine_options(p)
    add_cluster_options(p)
    p.set_defaults(run=run)


async def generate_all(config: EngineConfig, prompts: list[PromptLine],
                       params_for: Callable[[int], SamplingParams],
                       verbose: bool = False, args: argparse.Namespace | None = None) -> list[dict]:
    results: list[dict] = [{} for _ in prompts]
    refused: list[AdmissionError] = []

    async def one(engine: Engine, i: int) -> None:
        try:
            done = await engine.complete(prompts[i].prompt, params_for(i),
                                         scheduling=prompts[i].scheduling)
            results[i] = {"index": i, "token_ids": list(done.token_ids), "text": done.text,
                          "finish_reason": done.finish_reason}
        except AdmissionError as exc:
            if len(prompts) == 1:  # the one prompt refused: the command fails with its message
                refused.append(exc)
            results[i] = {"index": i, "token_ids": [], "text": "", "finish_reason": "error",
                          "error": str(exc)}
        except ShunterError as exc:
            results[i] = {"index": i, "token_ids": [], "text": "", "finish_reason": "error",
                          "error": str(exc)}

    async with start_engine(config, args or argparse.Namespace()) as engine:
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, engine, i)
        if verbose:
            snap = await engine.inspect()
            for s in getattr(snap, "snapshots", (snap,)):
                print(preemption_report(s) if s is not None else "instance down",
                      file=sys.stderr)
    if refused:
        raise refused[0]
    return results


def preemption_report(snap: EngineSnapshot) -> str:
    """`generate -v`'s last line: how often requests lost their KV blocks, and the swap traffic."""
    line = f"preemptions: {snap.scheduler.preemptions}"
    c = snap.scheduler.prefix_cache
    cache = "" if c is None or not c.queried_tokens else (
        f"; prefix cache: {c.hit_tokens} of {c.queried_tokens} tokens hit "
        f"({100 * c.hit_tokens / c.queried_tokens:.1f}%), {c.hit_blocks} of {c.queried_blocks} "
        f"blocks, {c.evicted_blocks} evicted")
    if snap.swap is None:
        return f"{line}; swap: none (this engine has no swap space){cache}"
    s = snap.swap
    return (f"{line}; swap: {s.blocks_out} KV blocks out, {s.blocks_in} in "
            f"({s.sync_swap_ins} sync and {s.async_swap_ins} async swap-ins, "
            f"{s.stall_s * 1e3:.1f} ms stalled){cache}")


def run(args: argparse.Namespace) -> int:
    prompts = ([prompt_from_option(args.prompt)] if args.prompt is not None
               else read_prompts(args.prompts_file))

    def params_for(i: int) -> SamplingParams:
        line = prompts[i]
        fields = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, ignore_eos=args.ignore_eos,
                      seed=None if args.seed is None else args.seed + i) | line.sampling
        try:
            return SamplingParams(**fields)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{line.where}: {exc}") from None

    for i in range(len(prompts)):  # validate every line before loading the model
        params_for(i)
    results = anyio.run(generate_all, engine_config(args, **cluster_fields(args)), prompts,
                        params_for, args.verbose, args,
                        backend=args.async_backend)
    failed = 0
    for r in results:
        failed += r["finish_reason"] == "error"
        if args.json:
            print(json.dumps(r))
        else:
            if len(results) > 1:
                print(f"--- [{r['index']}] ({r['finish_reason']})")
            print(r.get("error") or r["text"])
    if failed:
        print(f"{failed} of {len(results)} prompts failed", file=sys.stderr)
    return 1 if failed else 0
