"""Soak: thousands of concurrent requests on the torch backend with a tiny random model and a KV
pool small enough that requests are swapped out all the time (FastSwitch's policy), with random
priorities and tenants, multi-turn conversations, clients that cancel at random points (before
admission, before their first token, mid-stream: under this pressure a request between tokens is
most often swapped out), and the policy replaced live among the three that swap block groups;
run under asyncio and then trio. It checks that every request ends (completed, cancelled, or
failed with a message), that no KV block is left on the device or the host (once idle only the
conversations' kept turns hold host blocks), and that every completed greedy request equals its
reference, and every cancelled one a prefix of it. The reference of a prompt is what an engine
with an ample pool and no pressure (FCFS, no preemption) answers.

    python bench/soak.py [--requests 10000] [--concurrency 1000] [--seed 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import anyio
import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.logs import configure
from policies import policy_dir, policy_path
from shunter import (
    Engine,
    EngineConfig,
    SamplingParams,
    SchedulingParams,
    ShunterError,
)

TENANTS = ("alice", "bob", "carol", "dave")
REPLACEMENTS = ("groups_markov", "reuse_markov", "fastswitch_markov")
"""Policies that swap block groups, like the one the engine starts with (any other swap
granularity is refused, shunter/policy_source.py)."""
CANCEL_MODES = (("before_admission", 0.04), ("timed", 0.06), ("mid_stream", 0.10))


@attrs.frozen
class Template:
    """A session: one request, or a conversation whose turn k sends the earlier turns' user
    text and reference answers, then its own user text."""

    users: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]


def make_templates(rng: random.Random, n: int, vocab: int) -> list[Template]:
    out = []
    for _ in range(n):
        turns = rng.choice((1, 1, 2, 3))
        users = tuple(tuple(rng.randrange(4, vocab) for _ in range(rng.randint(4, 24)))
                      for _ in range(turns))
        out.append(Template(users=users, max_tokens=tuple(rng.randint(2, 12) for _ in users)))
    return out


def prompt_of(t: Template, turn: int, refs: dict[tuple[int, ...], tuple[int, ...]]) -> tuple[int, ...]:
    ids: tuple[int, ...] = ()
    for k in range(turn):
        ids += t.users[k]
        ids += refs[ids]
    return ids + t.users[turn]


async def references(model: Path, templates: list[Template]) -> dict:
    """Every turn's greedy answer from an engine with an ample pool and no preemption."""
    config = EngineConfig(model=model, num_blocks=2048, max_num_seqs=32, threads=1,
                          max_queued_requests=len(templates) + 16,
                          cpu_swap_blocks=0, policy=policy_path("fcfs"))
    refs: dict[tuple[int, ...], tuple[int, ...]] = {}
    async with Engine.start(config) as engine:
        for turn in range(3):
            todo = {prompt_of(t, turn, refs): t.max_tokens[turn] for t in templates
                    if turn < len(t.users)}

            async def one(prompt: tuple[int, ...], max_tokens: int) -> None:
                done = await engine.complete(list(prompt), SamplingParams(max_tokens=max_tokens))
                refs[prompt] = tuple(done.token_ids)

            async with anyio.create_task_group() as tg:
                for prompt, max_tokens in todo.items():
                    tg.start_soon(one, prompt, max_tokens)
    return refs


@attrs.define
class Tally:
    outcomes: Counter = attrs.field(factory=Counter)
    """completed, cancelled_before_admission, cancelled_before_first_token,
    cancelled_mid_stream, failed."""
    errors: Counter = attrs.field(factory=Counter)
    mismatches: list = attrs.field(factory=list)
    replacements: int = 0
    replacement_errors: list = attrs.field(factory=list)
    samples: int = 0
    samples_swapped: int = 0

    def check(self, prompt: tuple[int, ...], got: list[int], want: tuple[int, ...],
              whole: bool) -> None:
        if (tuple(got) != want) if whole else (tuple(got) != want[:len(got)]):
            self.mismatches.append({"prompt": list(prompt), "got": got, "want": list(want)})


async def one_turn(engine: Engine, prompt: tuple[int, ...], want: tuple[int, ...],
                   params: SamplingParams, scheduling: SchedulingParams,
                   rng: random.Random, tally: Tally) -> None:
    mode = rng.choices([m for m, _ in CANCEL_MODES] + ["none"],
                       [w for _, w in CANCEL_MODES] + [1 - sum(w for _, w in CANCEL_MODES)])[0]
    cut = rng.randint(1, max(1, params.max_tokens - 1))
    got: list[int] = []
    finish = error = None
    stream = engine.generate(list(prompt), params, scheduling=scheduling)
    try:
        with anyio.CancelScope() as scope:
            if mode == "before_admission":
                scope.cancel()
            elif mode == "timed":
                scope.deadline = anyio.current_time() + rng.uniform(0.0, 0.2)
            async for chunk in stream:
                got.extend(chunk.token_ids)
                finish, error = chunk.finish_reason, chunk.error
                if mode == "mid_stream" and len(got) >= cut and finish is None:
                    break
    except ShunterError as exc:
        finish, error = "failed", f"{type(exc).__name__}: {exc}"
    finally:
        await stream.aclose()
    if finish in ("stop", "length"):
        tally.outcomes["completed"] += 1
        tally.check(prompt, got, want, whole=True)
    elif finish is None or finish == "cancelled":
        where = ("before_admission" if mode == "before_admission" else
                 "before_first_token" if not got else "mid_stream")
        tally.outcomes[f"cancelled_{where}"] += 1
        tally.check(prompt, got, want, whole=False)
    else:  # `error`, a refusal, or (a defect) a request cut short at `pool`/`context`
        tally.outcomes["failed"] += 1
        tally.errors[f"{finish}: {error}"] += 1


async def session(engine: Engine, sid: int, t: Template, refs: dict, seed: int,
                  limiter: anyio.CapacityLimiter, tally: Tally) -> None:
    rng = random.Random(seed * 1_000_003 + sid)
    async with limiter:
        await anyio.sleep(rng.uniform(0.0, 0.05))
        for turn in range(len(t.users)):
            prompt = prompt_of(t, turn, refs)
            scheduling = SchedulingParams(
                priority=rng.randrange(4), tenant=rng.choice(TENANTS),
                conversation_id=f"conv-{sid}" if len(t.users) > 1 else None)
            await one_turn(engine, prompt, refs[prompt], SamplingParams(max_tokens=t.max_tokens[turn]),
                           scheduling, rng, tally)


async def replace_policies(engine: Engine, every_s: float, tally: Tally) -> None:
    for n in range(1_000_000):
        await anyio.sleep(every_s)
        name = REPLACEMENTS[n % len(REPLACEMENTS)]
        try:
            await engine.replace_policy(policy_path(name).read_text(), base_dir=policy_dir())
            tally.replacements += 1
        except ShunterError as exc:
            tally.replacement_errors.append(f"{name}: {exc}")


async def sample_swapping(engine: Engine, tally: Tally) -> None:
    """How often some request is swapped out (or being swapped in), sampled every 20 ms."""
    while True:
        await anyio.sleep(0.02)
        snap = (await engine.inspect()).scheduler
        tally.samples += 1
        tally.samples_swapped += bool(snap.swapped or snap.swapping_in)


def soak_config(model: Path, requests: int) -> EngineConfig:
    """16 blocks of 16 tokens for batches of up to 16 sequences of up to ~110 tokens: two to
    eight fit at once, the rest wait, most of them swapped out."""
    return EngineConfig(model=model, block_size=16, num_blocks=16, max_num_seqs=16,
                        max_batched_tokens=256, max_queued_requests=requests + 16, threads=1,
                        cpu_swap_blocks=4096, policy=policy_path("fastswitch_markov"))


async def soak(model: Path, templates: list[Template], refs: dict, *, seed: int,
               concurrency: int, replace_every_s: float, timeout_s: float) -> dict:
    tally = Tally()
    requests = sum(len(t.users) for t in templates)
    began = time.perf_counter()
    async with Engine.start(soak_config(model, requests)) as engine:
        with anyio.fail_after(timeout_s):
            async with anyio.create_task_group() as watchers:
                watchers.start_soon(replace_policies, engine, replace_every_s, tally)
                watchers.start_soon(sample_swapping, engine, tally)
                limiter = anyio.CapacityLimiter(concurrency)
                async with anyio.create_task_group() as tg:
                    for sid, t in enumerate(templates):
                        tg.start_soon(session, engine, sid, t, refs, seed, limiter, tally)
                watchers.cancel_scope.cancel()
            snap = await engine.wait_idle()
    wall = time.perf_counter() - began
    s, swap = snap.scheduler, snap.swap
    return {
        "requests": requests, "sessions": len(templates), "concurrency": concurrency,
        "outcomes": dict(tally.outcomes), "ended": sum(tally.outcomes.values()),
        "errors": dict(tally.errors), "mismatches": len(tally.mismatches),
        "mismatch_examples": tally.mismatches[:3],
        "policy_replacements": tally.replacements, "replacement_errors": tally.replacement_errors,
        "iterations": s.iteration, "preemptions": s.preemptions,
        "cancelled_by_state": dict(s.cancelled_by_state),
        "swap_blocks_out": swap.blocks_out if swap else 0,
        "swap_blocks_in": swap.blocks_in if swap else 0,
        "share_of_samples_with_a_request_swapped": round(tally.samples_swapped / max(1, tally.samples), 3),
        "device_blocks_left": snap.allocator.allocated_blocks,
        "host_blocks_leaked": s.cpu_total_blocks - s.cpu_free_blocks - s.cpu_kept_blocks,
        "host_blocks_kept_for_conversations": s.cpu_kept_blocks,
        "wall_s": round(wall, 1),
    }


def problems(result: dict) -> list[str]:
    """What the soak found wrong (empty when it passed)."""
    out = []
    if result["ended"] != result["requests"]:
        out.append(f"{result['requests'] - result['ended']} requests never ended")
    if result["mismatches"]:
        out.append(f"{result['mismatches']} outputs differ from the reference")
    if result["device_blocks_left"] or result["host_blocks_leaked"]:
        out.append(f"leaked blocks: device {result['device_blocks_left']}, "
                   f"host {result['host_blocks_leaked']}")
    unclear = [e for e in result["errors"] if not e.split(": ", 1)[-1].strip()]
    if unclear or any(e.startswith(("pool", "context")) for e in result["errors"]):
        out.append(f"failures without a clear error: {result['errors']}")
    if result["replacement_errors"]:
        out.append(f"policy replacements refused: {result['replacement_errors'][:3]}")
    return out


def run(model: Path, requests: int, *, seed: int = 0, concurrency: int = 2000,
        backends: tuple[str, ...] = ("asyncio", "trio"), replace_every_s: float = 0.1,
        timeout_s: float = 3600.0) -> dict:
    """Split `requests` over the backends; each run checks against the same references."""
    rng = random.Random(seed)
    per: list[list[Template]] = []
    for _ in backends:
        ts: list[Template] = []
        while sum(len(t.users) for t in ts) < requests // len(backends):
            ts.extend(make_templates(rng, 1, vocab=320))
        per.append(ts)
    began = time.perf_counter()
    refs = anyio.run(references, model, [t for ts in per for t in ts])
    out: dict = {"reference_s": round(time.perf_counter() - began, 1), "runs": {}}
    for backend, ts in zip(backends, per):
        out["runs"][backend] = anyio.run(
            lambda ts=ts: soak(model, ts, refs, seed=seed, concurrency=concurrency,
                               replace_every_s=replace_every_s, timeout_s=timeout_s),
            backend=backend)
    return out


def tiny_model(where: Path) -> Path:
    from gpu.make_model import write_random_model

    write_random_model(where, arch="llama", layers=2, hidden=64, heads=4, kv_heads=2,
                       vocab=320, seed=0)
    return where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=2000,
                        help="sessions live at once (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="default: a tiny random Llama, built here")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    configure(logging.WARNING)  # an info line per policy replacement would drown the report
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_model(Path(tmp))
        result = run(model, args.requests, seed=args.seed, concurrency=args.concurrency)
    result["problems"] = {b: problems(r) for b, r in result["runs"].items()}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(1 if any(result["problems"].values()) else 0)


if __name__ == "__main__":
    main()
