"""`shunter generate`: run prompts through the engine, all at once, and print the results."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import anyio

from engine.errors import InvalidRequestError, ShunterError
from engine.params import SamplingParams
from shunter.commands.common import add_engine_options, engine_config
from shunter.engine import Engine


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt or a file of prompts",
                       description="Submit every prompt at once (they are served concurrently) "
                                   "and print each result, in input order.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-file", type=Path,
                     help='JSONL: one {"prompt": "..."} or {"prompt_ids": [...]} per line')
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="per-request seed (request i gets seed+i)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--json", action="store_true",
                   help='print {"index", "token_ids", "text", "finish_reason"} per prompt, one a line')
    add_engine_options(p)
    p.set_defaults(run=run)


def read_prompts(path: Path) -> list[str | list[int]]:
    """Prompts from a JSONL file; errors name the file and line."""
    prompts: list[str | list[int]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"{path}: cannot read prompts file: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{path}:{n}: not JSON: {exc.msg}") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif isinstance(obj, dict) and isinstance(obj.get("prompt_ids"), list) and all(
                isinstance(t, int) for t in obj["prompt_ids"]):
            prompts.append(obj["prompt_ids"])
        else:
            raise InvalidRequestError(
                f'{path}:{n}: expected {{"prompt": "..."}} or {{"prompt_ids": [ints]}}')
    if not prompts:
        raise InvalidRequestError(f"{path}: no prompts")
    return prompts


async def generate_all(config, prompts, params_for) -> list[dict]:
    results: list[dict] = [{} for _ in prompts]

    async def one(engine: Engine, i: int) -> None:
        try:
            done = await engine.complete(prompts[i], params_for(i))
            results[i] = {"index": i, "token_ids": list(done.token_ids), "text": done.text,
                          "finish_reason": done.finish_reason}
        except ShunterError as exc:
            results[i] = {"index": i, "token_ids": [], "text": "", "finish_reason": "error",
                          "error": str(exc)}

    async with Engine.start(config) as engine:
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, engine, i)
    return results


def run(args: argparse.Namespace) -> int:
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts_file)

    def params_for(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, ignore_eos=args.ignore_eos,
                              seed=None if args.seed is None else args.seed + i)

    params_for(0)  # validate once, before loading the model
    results = anyio.run(generate_all, engine_config(args), prompts, params_for,
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
