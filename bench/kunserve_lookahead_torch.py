"""KunServe §4.3 on torch: lookahead microbatches against token-count ones in a real pipeline
group of two instance processes (gloo), on the same queued windows.

    python bench/kunserve_lookahead_torch.py [--rounds 6] [--warmup 4] [--window 12]
                                [--decodes 3] [--layers 8] [--hidden 256] [--microbatches 4]

Rank 0 leads a group with rank 1 (layers split in half; gpu/group_runner.py GroupRunner driven
directly, the instances' engines stood in for by this script). Each window is a burst of queued
requests (prompts mixed: 70% of 8-48 tokens, 30% of 160-480, seeded) prefilled in one step (the
lookahead window) and then decoded for --decodes steps; every round runs the same window once
cut by tokens (whole sequences, about equal tokens: engine/cluster/plan.py) and once by
lookahead (Eq. 1-3 fitted per stage on the microbatches measured so far, prefills cut where
the balance falls: engine/cluster/stage_fits.py), the order alternating. --warmup windows first
(cut by tokens and by lookahead in turn) give the fits their samples, as the paper's offline
profiling does (with --cost-profile the fits start from that profile instead, as a torch
engine's do: engine/cluster/stage_fits.py `seed`). Both ways add their measured microbatches to
the same fits.

Reported per way: the bubble ratio of the steps' GPipe schedule replayed with each stage's
measured microbatch times (1 - busy / (stages x makespan); activation transfer not counted; a
stage's time is its thread's CPU time: one intra-op thread per process, so this is what the
stage takes on a core of its own, whatever else shares the host: gpu/group_stage.py `cpu_s`),
for the prefill steps and for all steps; the same from the steps' wall time (both processes
share this host's cores: read it with care); and the cost model's held-out prediction error
(each microbatch predicted by the fit of before it ran) against a token-count model's. Writes
bench/results/kunserve_lookahead_torch.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BLOCK = 16
CONTEXT = 1024
"""The random model's context (`max_position_embeddings`)."""


def _load(model_dir: str, rank: int, init: str, blocks: int):
    import torch

    from engine.config import EngineConfig
    from gpu.config import ModelConfig
    from gpu.data_plane import join_data_plane
    from gpu.kunserve_runner import KunServeTorchRunner

    torch.set_num_threads(1)
    join_data_plane(init, rank, 2, timeout_s=120)
    config = EngineConfig(model=model_dir, device="cpu", threads=1, num_blocks=blocks,
                          block_size=BLOCK, cpu_swap_blocks=0)
    runner = KunServeTorchRunner(config, ModelConfig.from_dir(model_dir), blocks)
    runner._load()
    return runner


def _member(model_dir: str, init: str, blocks: int) -> None:
    from gpu.group_member import serve_member

    serve_member(_load(model_dir, 1, init, blocks), 0)
    os._exit(0)  # its work is done; a normal exit aborted in torch's teardown (signal 6,
    # "terminate called without an active exception" on the bench's stderr), as did the
    # bench's own (exit code 134 after writing its results)


def start_pair(args, prefix: str, member):
    """A random Llama of `args.layers` x `args.hidden` written to a fresh directory, rank 1
    (`member(model_dir, init, blocks)`) started in its own process and rank 0 loaded here, both
    joined over gloo on loopback: (model_dir, rank 1's process, rank 0's runner)."""
    from gpu.data_plane import free_port
    from gpu.make_model import write_random_model

    model_dir = str(write_random_model(tempfile.mkdtemp(prefix=prefix), arch="llama",
                                       layers=args.layers, hidden=args.hidden, heads=8,
                                       kv_heads=4, vocab=512, seed=3,
                                       max_position_embeddings=CONTEXT))
    init = f"tcp://127.0.0.1:{free_port()}"
    process = mp.get_context("spawn").Process(target=member, args=(model_dir, init, args.blocks),
                                              daemon=True)
    process.start()
    return model_dir, process, _load(model_dir, 0, init, args.blocks)


def _window(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(2, 500) for _ in range(
        rng.randint(8, 48) if rng.random() < 0.7 else rng.randint(160, 480))] for _ in range(n)]


def _run_window(group, prompts, decodes: int, step_id: int, first_rid: int, detail=None):
    """Prefill `prompts` in one step, decode `decodes` steps, release; returns the step id
    after and [(is_prefill, replayed busy, stages x makespan, wall busy, stages x wall)]."""
    from engine.messages import BlockUpdate, ExecuteStep, RequestSetup, SeqWork
    from engine.params import SamplingParams

    greedy = SamplingParams(max_tokens=decodes + 1, temperature=0)
    free = list(reversed(group.pool))
    rids = list(range(first_rid, first_rid + len(prompts)))
    need = sum(-(-(len(p) + decodes + 1) // BLOCK) for p in prompts)
    if need > len(free):
        raise SystemExit(f"a window of {len(prompts)} prompts needs {need} blocks; the group's "
                         f"pool has {len(free)}: raise --blocks or lower --window")
    tables = {r: [free.pop() for _ in range(-(-(len(p) + decodes + 1) // BLOCK))]
              for r, p in zip(rids, prompts)}
    out = []
    for k in range(decodes + 1):
        t, w = group.totals, group.wall
        before = (t.busy_s, t.stage_s, w[0], w[1])
        if k == 0:
            setups = tuple(RequestSetup(request_id=r, prompt_ids=tuple(p), sampling=greedy,
                                        eos_token_ids=()) for r, p in zip(rids, prompts))
            blocks = tuple(BlockUpdate(request_id=r, reset=False, append=tuple(tables[r]))
                           for r in rids)
            seqs = tuple(SeqWork(request_id=r, start=0, num_tokens=len(p), sample=True)
                         for r, p in zip(rids, prompts))
        else:
            setups, blocks = (), ()
            seqs = tuple(SeqWork(request_id=r, start=len(p) + k - 1, num_tokens=1, sample=True)
                         for r, p in zip(rids, prompts))
        step_id += 1
        n_err, n_tok = len(group.fits.errors), len(group.fits.token_errors)
        model = group.fits.model() if group.fits.fitted else None
        group.execute(ExecuteStep(step_id=step_id, release=(), setups=setups, blocks=blocks,
                                  seqs=seqs))
        if k == 0 and detail is not None and model is not None:
            cut = group.last_cut
            detail.append({"mode": group.microbatch,
                           "tokens": [[n for _, _, n in mb] for mb in cut],
                           "predicted_ms": [model.batch_ms([(s, n) for _, s, n in mb])
                                            for mb in cut],
                           "measured_ms": [[x * 1e3 for x in row]
                                           for row in group.last_stage_s]})
        t, w = group.totals, group.wall
        out.append((k == 0, t.busy_s - before[0], t.stage_s - before[1], w[0] - before[2],
                    w[1] - before[3], group.fits.errors[n_err:], group.fits.token_errors[n_tok:]))
    step_id += 1
    group.execute(ExecuteStep(step_id=step_id, release=tuple(rids), setups=(), blocks=(),
                              seqs=()))
    return step_id, out


def _ratio(rows, prefill_only: bool, wall: bool) -> float | None:
    rows = [r for r in rows if r[0] or not prefill_only]
    busy = sum(r[3 if wall else 1] for r in rows)
    span = sum(r[4 if wall else 2] for r in rows)
    return 1 - busy / span if span else None


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def fmt(x: float | None, spec: str = ".3f") -> str:
    """A metric for the report; one with nothing measured (None) is `n/a`."""
    return "n/a" if x is None else format(x, spec)


def report_line(mode: str, m: dict) -> str:
    return (f"{mode:9s} bubble prefill {fmt(m['bubble_prefill'])} all {fmt(m['bubble_all'])} "
            f"(wall {fmt(m['wall_bubble_prefill'])} / {fmt(m['wall_bubble_all'])}); "
            f"Eq.1-3 error mean {fmt(m['prediction_error_mean'])} median "
            f"{fmt(m['prediction_error_median'])} (prefill steps "
            f"{fmt(m['prediction_error_prefill_steps'])}, decode "
            f"{fmt(m['prediction_error_decode_steps'])}); token model "
            f"{fmt(m['tokens_model_error_mean'])} (prefill steps "
            f"{fmt(m['tokens_model_error_prefill_steps'])})")


def at_least(ap: argparse.ArgumentParser, args, **least: int) -> None:
    """Refuse (argparse's usage error, before any process starts) an argument below its least
    useful value, naming it."""
    for name, low in least.items():
        value = getattr(args, name)
        if value < low:
            ap.error(f"--{name.replace('_', '-')} must be at least {low}, got {value}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--window", type=int, default=12)
    ap.add_argument("--decodes", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--cost-profile", default=None,
                    help="a profile fitted for this model's shapes (`shunter profile fit`): the "
                         "fits start from it (offline profiling) instead of the warm-up alone")
    ap.add_argument("--out", default="bench/results/kunserve_lookahead_torch.json")
    args = ap.parse_args(argv)
    at_least(ap, args, rounds=1, warmup=0, window=1, decodes=0, layers=2, microbatches=1,
             blocks=1)
    if args.decodes > CONTEXT - 481:  # the longest prompt of a window is 480 tokens
        ap.error(f"--decodes must be at most {CONTEXT - 481} (a {CONTEXT}-token context), got "
                 f"{args.decodes}")
    if args.hidden < 16 or args.hidden % 16:
        ap.error(f"--hidden must be a multiple of 16 (8 heads of an even size), got "
                 f"{args.hidden}")
    return args


def main() -> None:
    args = parse_args()

    from engine.cluster.drop_plan import GroupPlan
    from gpu.group_runner import GroupRunner
    model_dir, member, runner = start_pair(args, "kunserve-lookahead-", _member)
    half = args.layers // 2
    plan = GroupPlan(group_id=1, members=(0, 1),
                     layers=(range(half), range(half, args.layers)))
    group = GroupRunner(runner, plan.members, plan.layers, microbatches=args.microbatches)
    group.open()
    if args.cost_profile:
        from engine.config import EngineConfig
        from engine.cost_model import BatchShape
        from shunter.backends import build_backend

        backend = build_backend(EngineConfig(model=model_dir, backend="torch", device="cpu",
                                             block_size=BLOCK, num_blocks=8,
                                             cost_profile=args.cost_profile))
        backend.runner.close()
        cost = backend.cost_model
        group.fits.seed(lambda chunks: cost.predict_ms(BatchShape.of(chunks)), [0.5, 0.5],
                        max_context=1024)
    detail: list[dict] = []
    rng = random.Random(11)
    step_id, rid = 0, 1
    began = time.time()
    for w in range(args.warmup):  # the fits' first samples (the paper profiles offline)
        group.microbatch = ("tokens", "lookahead")[w % 2]
        step_id, _ = _run_window(group, _window(rng, args.window), args.decodes, step_id, rid)
        rid += args.window
    rows: dict[str, list] = {"tokens": [], "lookahead": []}
    errors: dict[str, list] = {"tokens": [], "lookahead": []}
    tok_errors: dict[str, list] = {"tokens": [], "lookahead": []}
    for r in range(args.rounds):
        prompts = _window(rng, args.window)
        for mode in (("tokens", "lookahead") if r % 2 == 0 else ("lookahead", "tokens")):
            group.microbatch = mode
            n_err, n_tok = len(group.fits.errors), len(group.fits.token_errors)
            step_id, out = _run_window(group, prompts, args.decodes, step_id, rid, detail)
            rid += args.window
            rows[mode] += out
            errors[mode] += group.fits.errors[n_err:]
            tok_errors[mode] += group.fits.token_errors[n_tok:]
    group.restore({})
    member.join(timeout=60)
    rep = group.fits.report()
    result = {"args": vars(args), "load_average": os.getloadavg(),
              "stage_clock": "thread cpu" if group.cpu_clock else "wall",
              "seconds": time.time() - began, "fit": rep["fit"], "samples": rep["samples"],
              "split_chunks": rep["split_chunks"], "prefill_steps": detail}
    for mode, mode_rows in rows.items():
        result[mode] = {
            "bubble_prefill": _ratio(mode_rows, True, False),
            "bubble_all": _ratio(mode_rows, False, False),
            "wall_bubble_prefill": _ratio(mode_rows, True, True),
            "wall_bubble_all": _ratio(mode_rows, False, True),
            "prediction_error_mean": statistics.fmean(errors[mode]) if errors[mode] else None,
            "prediction_error_median": statistics.median(errors[mode]) if errors[mode] else None,
            "tokens_model_error_mean": (statistics.fmean(tok_errors[mode])
                                        if tok_errors[mode] else None),
            "microbatches_measured": len(errors[mode]),
            "prediction_error_prefill_steps": _mean([e for r in mode_rows if r[0] for e in r[5]]),
            "prediction_error_decode_steps": _mean([e for r in mode_rows if not r[0]
                                                    for e in r[5]]),
            "tokens_model_error_prefill_steps": _mean([e for r in mode_rows if r[0]
                                                       for e in r[6]])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for mode in rows:
        print(report_line(mode, result[mode]))
    print(f"load average {result['load_average']}, {result['seconds']:.1f} s, wrote {args.out}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the member: gloo's threads of the group's channel (never destroyed:
    # gloo cannot shut a process group down) aborted the teardown, exit code 134


if __name__ == "__main__":
    main()
