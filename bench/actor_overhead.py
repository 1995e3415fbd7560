"""Per-iteration cost of the actors themselves: the engine runs with a runner that does no work,
so an iteration's wall time is scheduling + messaging (scheduler -> allocator -> executor ->
scheduler, and the outputs to the frontend) + streaming to clients. The planner's share is
measured apart by calling it directly on the same shape of state.

    python bench/actor_overhead.py [--requests 64] [--tokens 200] [--async-backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.messages import ExecuteStep, SampledToken, StepFinished  # noqa: E402
from engine.planner import Budget, plan_iteration  # noqa: E402
from engine.policy import FcfsPolicy, SchedulerView  # noqa: E402
from engine.request import Request  # noqa: E402
from shunter import Engine, EngineConfig, SamplingParams
from shunter.backends import Backend  # noqa: E402


class NullRunner:
    """Samples token 7 for every sequence that asks, instantly."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    async def start(self) -> range:
        return range(self.num_blocks)

    async def step(self, step: ExecuteStep) -> StepFinished:
        sampled = tuple(SampledToken(request_id=w.request_id, token_id=7) for w in step.seqs if w.sample)
        return StepFinished(step_id=step.step_id, sampled=sampled, compute_s=0.0)


async def engine_run(requests: int, tokens: int) -> tuple[float, int]:
    backend = Backend(runner=NullRunner(100_000), codec=None, vocab_size=100, eos_token_ids=(1,),
                      max_context=100_000, max_prompt_tokens=99_999)
    config = EngineConfig(max_num_seqs=requests, max_batched_tokens=max(512, requests * 16))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    async with Engine.start(config, backend=backend) as engine:
        began = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(requests):
                tg.start_soon(engine.complete, [5] * 16, params)
        wall = time.perf_counter() - began
        iterations = (await engine.inspect()).scheduler.iteration
    return wall, iterations


def planner_only(requests: int, repeats: int) -> float:
    policy = FcfsPolicy()
    live = [Request(id=i, request_class="default", priority=0, tenant="t", conversation_id=None,
                    turn=1, arrival=float(i), ttft_ms=None, tpot_ms=None, prompt_ids=[5] * 16,
                    sampling=SamplingParams(max_tokens=1000), stop_ids=frozenset(),
                    eos_token_ids=(), state="running", output_ids=[7] * 5, computed_tokens=20,
                    blocks=2)
            for i in range(requests)]
    budget = Budget(free_blocks=10_000, total_blocks=100_000, block_size=16,
                    max_num_seqs=requests, max_batched_tokens=max(512, requests * 16))
    began = time.perf_counter()
    for it in range(repeats):
        views = [r.view() for r in live]  # kept until a request changes, as the engine does
        view = SchedulerView(now=float(it), iteration=it, requests=views, free_blocks=10_000,
                             total_blocks=100_000, block_size=16, max_num_seqs=requests,
                             max_batched_tokens=512)
        plan_iteration(policy.decide(view), views, budget)
    return (time.perf_counter() - began) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--async-backend", default="asyncio", choices=("asyncio", "trio"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    wall, iterations = anyio.run(engine_run, args.requests, args.tokens, backend=args.async_backend)
    plan_s = planner_only(args.requests, 200)
    per_iter = wall / iterations
    result = {
        "async_backend": args.async_backend, "requests": args.requests, "iterations": iterations,
        "ms_per_iteration": per_iter * 1000, "planner_ms_per_iteration": plan_s * 1000,
        "messaging_and_streaming_ms_per_iteration": (per_iter - plan_s) * 1000,
        "us_per_request_per_iteration": per_iter / args.requests * 1e6,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
