"""KunServe §4.2/§5.3 on torch, the ablation step `kunserve_drop` -> `kunserve_exchange`: how
long a real pipeline group's activations stall behind the KV exchange, with one FIFO queue
(`kv_exchange fifo`) against the coordinated one (chunks behind activations).

    python bench/kunserve_fifo_torch.py [--rounds 6] [--old 16] [--old-tokens 512]
                                        [--new 8] [--steps 8] [--layers 8] [--hidden 256]

Two processes joined over gloo (loopback). Each round, once per way (the order alternating),
rank 0 opens a group with rank 1 (gpu/group_runner.py `GroupRunner`, layers split in half)
while it holds --old requests of --old-tokens tokens each: their KV for the layers rank 1 keeps
(MiB reported) is exchanged as the group forms, exactly as when a drop adopts requests in
flight. Right away the group serves --new new requests (no KV to wait for: a prefill of 32
tokens each, then decodes) for --steps steps; per step the wall time and the time rank 1's
stage waited for its activations (`wait_s`) are recorded. The old requests' KV content is
whatever their blocks hold (only its bytes matter here; outputs are checked by
tests/cluster/test_kunserve_torch_faults.py). Then the group restores (the old requests
released first, so only weights move back) and rank 1 serves alone until the next round.
Writes bench/results/kunserve_fifo_torch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kunserve_lookahead_torch import BLOCK, CONTEXT, _load, at_least, fmt, start_pair


def _member(model_dir: str, init: str, blocks: int) -> None:
    from gpu.group_member import serve_member

    runner = _load(model_dir, 1, init, blocks)
    while serve_member(runner, 0).get("formed", True):
        pass


def _old_requests(runner, n: int, tokens: int) -> None:
    """`n` requests holding `tokens` tokens of KV on rank 0 alone (the group exchanges it)."""
    from engine.params import SamplingParams
    from gpu.runner import _DeviceSeq

    ids = iter(runner._model.arena.kv_block_ids)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    for rid in range(n):
        table = [next(ids) for _ in range(-(-tokens // BLOCK))]
        runner._seqs[rid] = _DeviceSeq(tokens=[rid % 400 + 2] * tokens, table=table,
                                       sampling=greedy, generator=None)


def _serve_new(group, n: int, steps: int, first_rid: int, used: set[int]) -> list[dict]:
    from engine.messages import BlockUpdate, ExecuteStep, RequestSetup, SeqWork
    from engine.params import SamplingParams

    greedy = SamplingParams(max_tokens=steps + 1, temperature=0)
    free = [b for b in group.pool if b not in used]
    rids = list(range(first_rid, first_rid + n))
    prompts = {r: [(r * 7 + i) % 500 + 2 for i in range(32)] for r in rids}
    need = n * -(-(32 + steps + 1) // BLOCK)
    if need > len(free):
        raise SystemExit(f"--new {n} requests need {need} blocks; the group's pool has "
                         f"{len(free)} free beside the old requests: raise --blocks")
    tables = {r: [free.pop() for _ in range(-(-(32 + steps + 1) // BLOCK))] for r in rids}
    group.records = []
    out = []
    for k in range(steps):
        if k == 0:
            setups = tuple(RequestSetup(request_id=r, prompt_ids=tuple(prompts[r]),
                                        sampling=greedy, eos_token_ids=()) for r in rids)
            blocks = tuple(BlockUpdate(request_id=r, reset=False, append=tuple(tables[r]))
                           for r in rids)
            seqs = tuple(SeqWork(request_id=r, start=0, num_tokens=32, sample=True)
                         for r in rids)
        else:
            setups, blocks = (), ()
            seqs = tuple(SeqWork(request_id=r, start=32 + k - 1, num_tokens=1, sample=True)
                         for r in rids)
        began = time.perf_counter()
        group.execute(ExecuteStep(step_id=first_rid + k, release=(), setups=setups,
                                  blocks=blocks, seqs=seqs))
        rec = group.records[-1]
        out.append({"wall_ms": (time.perf_counter() - began) * 1e3,
                    "member_wait_ms": sum(rec.wait_s[1]) * 1e3,
                    "exchanging": len(group.exchanging())})
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--old", type=int, default=16)
    ap.add_argument("--old-tokens", type=int, default=512)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=640)
    ap.add_argument("--chunk-blocks", type=int, default=4)
    ap.add_argument("--out", default="bench/results/kunserve_fifo_torch.json")
    args = ap.parse_args(argv)
    # one step after the first ("later steps"); a split in two; KV to exchange
    at_least(ap, args, rounds=1, old=1, old_tokens=1, new=1, steps=2, layers=2, blocks=1,
             chunk_blocks=1)
    if args.hidden < 16 or args.hidden % 16:
        ap.error(f"--hidden must be a multiple of 16 (8 heads of an even size), got "
                 f"{args.hidden}")
    held = args.old * -(-args.old_tokens // BLOCK)
    if held > args.blocks:
        ap.error(f"--old {args.old} requests of --old-tokens {args.old_tokens} need {held} "
                 f"blocks of {BLOCK} tokens; the pool has --blocks {args.blocks}")
    if max(args.old_tokens, 32 + args.steps + 1) > CONTEXT:
        ap.error(f"--old-tokens and 33 + --steps must fit the model's {CONTEXT}-token context")
    return args


def main() -> None:
    args = parse_args()

    from engine.messages import ExecuteStep
    from gpu.group_runner import GroupRunner

    _, member, runner = start_pair(args, "kunserve-fifo-", _member)
    half = args.layers // 2
    layers = (range(half), range(half, args.layers))
    runs: list[dict] = []
    began = time.time()
    rid = 10_000
    for r in range(args.rounds + 1):  # round 0: warm-up, not reported
        for way in (("fifo", "coordinated") if r % 2 == 0 else ("coordinated", "fifo")):
            _old_requests(runner, args.old, args.old_tokens)
            used = {b for s in runner._seqs.values() for b in s.table}
            group = GroupRunner(runner, (0, 1), layers, chunk_blocks=args.chunk_blocks,
                                kv_exchange=way)
            t0 = time.perf_counter()
            group.open()
            steps = _serve_new(group, args.new, args.steps, rid, used)
            rid += 1000
            while group.exchanging():  # the rest of the exchange, by empty steps
                group.poll(rid)
                rid += 1
            exchange_s = time.perf_counter() - t0
            new = [q for q in group.stage.seqs if q >= 10_000]
            group.execute(ExecuteStep(step_id=rid, release=tuple(new), setups=(), blocks=(),
                                      seqs=()))
            rid += 1
            group.restore({}, release=tuple(group.stage.seqs))
            if r:
                runs.append({"round": r, "way": way, "steps": steps, "exchange_s": exchange_s,
                             "kv_bytes": group.exchange.sent_bytes})
    result = {"args": vars(args), "load_average": os.getloadavg(),
              "seconds": time.time() - began, "runs": runs}
    for way in ("fifo", "coordinated"):
        mine = [x for x in runs if x["way"] == way]
        first = [x["steps"][0] for x in mine]
        rest = [s for x in mine for s in x["steps"][1:]]
        result[way] = {
            "first_step_member_wait_ms_median": statistics.median(s["member_wait_ms"]
                                                                  for s in first),
            "first_step_wall_ms_median": statistics.median(s["wall_ms"] for s in first),
            "later_steps_member_wait_ms_median": statistics.median(s["member_wait_ms"]
                                                                   for s in rest),
            "later_steps_wall_ms_median": statistics.median(s["wall_ms"] for s in rest),
            "served_steps_wall_ms_total_median": statistics.median(
                sum(s["wall_ms"] for s in x["steps"]) for x in mine),
            "exchange_s_median": statistics.median(x["exchange_s"] for x in mine),
            "kv_mib": mine[0]["kv_bytes"] / 2**20}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for way in ("fifo", "coordinated"):
        m = result[way]
        print(f"{way:11s} {fmt(m['kv_mib'], '.1f')} MiB exchanged; first step: member waited "
              f"{fmt(m['first_step_member_wait_ms_median'], '.1f')} ms for activations, wall "
              f"{fmt(m['first_step_wall_ms_median'], '.1f')} ms; later steps "
              f"{fmt(m['later_steps_member_wait_ms_median'], '.2f')} / "
              f"{fmt(m['later_steps_wall_ms_median'], '.1f')} ms; {args.steps} steps "
              f"{fmt(m['served_steps_wall_ms_total_median'], '.1f')} ms; exchange "
              f"{fmt(m['exchange_s_median'] * 1e3, '.1f')} ms (medians of {args.rounds})")
    print(f"load average {result['load_average']}, {result['seconds']:.1f} s, wrote {args.out}")
    member.join(timeout=0)


if __name__ == "__main__":
    main()
