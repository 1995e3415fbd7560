"""Where RT tokens miss their TPOT, under `bros` and the ablations of its bidirectional KV cache
(issue 14: BROS §7.4.1 reports 1.63x TPOT attainment for the cache; we measured 1.00x).

One `rtbe` workload per point (same arrivals, seed, pool and budget for every policy, in one
process, scheduler time not charged: deterministic virtual time). Per run, over RT requests:

- TPOT attainment three ways: per request (TPOT <= 200 ms), per token with cumulative deadlines
  (token k due at first + k x TPOT: `metrics.by_class.rt.slo_attainment.tpot_per_token`, what
  packing's slack uses, `engine.policy.token_deadline`), and per token gap (token k due TPOT
  after token k-1: BROS §4.1 (6), "elapsed time since the last token is returned"), as a share
  of gaps (the engine's `slo_attainment.tpot_per_gap`, read from the run's metrics) and as the
  mean of each request's share (§7.1 averages per request; counted here);
- every gap over the TPOT, by cause: the request was preempted (recompute or swap) in it, it was
  left out of one or more iterations while running (the gap's skipped iterations), or it ran in
  every iteration and one took longer than the TPOT (model time, or waiting for copies);
- RT and BE requests preempted whole (planner victims, the fit's own swap-outs).

Policies: any shipped or file policy, with variants after a colon, joined by `+`:
- `self`: a running request that cannot get its next block is itself preempted by recompute,
  instead of evicting requests ranked below it (§7.4.1's "recomputation for requests failing to
  acquire cache blocks"; since round 10b the policy language's `short_of_block = self`, which
  the shipped `bros_no_bicache` uses, so `:self` changes only policies without it, such as
  `bench/bros_no_bicache_below.policy` or `bench/bros_no_bicache_no_displace.policy`);
- `gap`: a decoding request's next token is due TPOT after its last one (§4.1 (6)), not at
  first + k x TPOT, for packing's slack and order.

    python bench/bros_tpot.py --rates 4,8,12 --num-blocks 3500 --seeds 9,1,2 --json OUT
    python bench/bros_tpot.py --report OUT...
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bros_bicache_counts import args_or_report
from engine import planner, request
from engine.memory import bidirectional
from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.commands.bench import finite
from shunter.workloads import load_workload
from sim import runner

STEPS: list[tuple[float, float, float, float, dict[int, int]]] = []
"""(start, end, model s, stall s, request id -> tokens) per simulated step."""
PREEMPTS: list[tuple[float, int, str]] = []
"""(engine clock, request id, how) per whole-request preemption."""


def install() -> None:
    step = runner.SimRunner.step

    async def timed_step(self: Any, s: Any) -> Any:
        began = anyio.current_time()
        done = await step(self, s)
        STEPS.append((began, anyio.current_time(), done.compute_s, done.stall_s,
                      {w.request_id: w.num_tokens for w in s.seqs}))
        return done

    runner.SimRunner.step = timed_step  # type: ignore[method-assign]
    preempt = planner._Planner.preempt

    def noted_preempt(self: Any, v: Any) -> None:
        PREEMPTS.append((anyio.current_time(), v.id, "planner"))
        preempt(self, v)

    planner._Planner.preempt = noted_preempt  # type: ignore[method-assign]
    swap_out = bidirectional.BidirectionalBlocks.swap_out

    def noted_swap_out(self: Any, rid: int) -> Any:
        PREEMPTS.append((anyio.current_time(), rid, "table swap-out"))
        return swap_out(self, rid)

    bidirectional.BidirectionalBlocks.swap_out = noted_swap_out  # type: ignore[method-assign]


def gaps(token_times: tuple[float, ...]) -> list[tuple[float, float]]:
    return list(zip(token_times, token_times[1:]))


def tpot_counts(token_times: tuple[float, ...], tpot_s: float) -> tuple[int, int, int]:
    """(tokens after the first, of those on time by the cumulative deadline first + k x TPOT,
    of those on time by the gap deadline: within TPOT of the token before, §4.1 (6)). A stall
    after tokens that came faster than TPOT misses the second only: the first absorbs it."""
    if len(token_times) < 2:
        return 0, 0, 0
    first = token_times[0]
    cumulative = sum(t1 <= first + k * tpot_s + 1e-9
                     for k, (_t0, t1) in enumerate(gaps(token_times), start=1))
    gap = sum(t1 - t0 <= tpot_s + 1e-9 for t0, t1 in gaps(token_times))
    return len(token_times) - 1, cumulative, gap


def gap_request_mean(timelines: Any, goals: Any) -> float | None:
    """RT TPOT attainment by the gap deadline over a run's requests with a TPOT goal, as the
    mean of each request's share of its tokens after the first (§7.1 averages each request's
    attainment; the engine's metrics give the share of all tokens, `tpot_per_gap`); None when
    no request has a second token."""
    shares = []
    for t in timelines:
        g = goals.get(t.request_id)
        if g is None or g.tpot_ms is None:
            continue
        n, _cumulative, ok = tpot_counts(t.token_times, g.tpot_ms / 1000.0)
        if n:
            shares.append(ok / n)
    return sum(shares) / len(shares) if shares else None


def analyse(o: Any, tpot_s: float = 0.2) -> dict[str, Any]:
    """The RT requests' token gaps of one run, counted as the module docstring says: per
    request, the per-request mean of the gap count, and each late gap's cause (the engine's
    metrics give the per-token shares, `run` reads them)."""
    goals = o.drive.goals
    rt = [t for t in o.drive.timelines if (g := goals.get(t.request_id)) is not None
          and g.tpot_ms is not None]
    rt_ids = {t.request_id for t in rt}
    ends = [s[1] for s in STEPS]
    preempted: dict[int, list[float]] = {}
    for at, rid, _how in PREEMPTS:
        preempted.setdefault(rid, []).append(at)
    c: Counter[str] = Counter()
    per_request_gap_share, worst = [], []
    for t in rt:
        times, pre = t.token_times, preempted.get(t.request_id, [])
        if len(times) < 2:
            continue
        n, _cumulative, met = tpot_counts(times, tpot_s)
        for t0, t1 in gaps(times):
            if t1 - t0 <= tpot_s + 1e-9:
                continue
            c["gap_late"] += 1
            worst.append(t1 - t0)
            if any(t0 <= p < t1 for p in pre):
                c["late_preempted"] += 1
                continue
            # steps that ended inside the gap, the last of which produced the token
            lo, hi = bisect.bisect_right(ends, t0 + 1e-12), bisect.bisect_left(ends, t1 - 1e-12)
            within = STEPS[lo:hi + 1]
            skipped = sum(1 for s in within[:-1] if t.request_id not in s[4])
            if skipped:
                c["late_left_out"] += 1
                c["late_left_out_iterations"] += skipped
            elif within and within[-1][3] > 0 and within[-1][2] <= tpot_s:
                c["late_copy_stall"] += 1
            else:
                c["late_long_iteration"] += 1
        per_request_gap_share.append(met / n)
    pre_rt = sum(1 for _at, rid, _h in PREEMPTS if rid in rt_ids)
    decode_steps = [s for s in STEPS if any(rid in rt_ids and n == 1 for rid, n in s[4].items())]
    worst.sort()
    return {
        "rt_requests": len(rt),
        "tpot_ok_per_request": sum(1 for t in rt if len(t.token_times) < 2 or
                                   (t.token_times[-1] - t.token_times[0]) /
                                   (len(t.token_times) - 1) <= tpot_s + 1e-9) / max(1, len(rt)),
        "tpot_ok_per_gap_request_mean": (sum(per_request_gap_share) /
                                         max(1, len(per_request_gap_share))),
        "late_gaps": {k[5:]: v for k, v in c.items() if k.startswith("late_")},
        "late_gaps_total": c["gap_late"],
        "late_gap_p50_p99_max_ms": ([round(1000 * worst[int(q * (len(worst) - 1))], 1)
                                     for q in (0.5, 0.99, 1.0)] if worst else []),
        "rt_preemptions": pre_rt, "be_preemptions": len(PREEMPTS) - pre_rt,
        "iterations": len(STEPS),
        "iterations_over_tpot": sum(1 for s in STEPS if s[1] - s[0] > tpot_s),
        "rt_decode_iteration_mean_ms": (1000 * sum(s[1] - s[0] for s in decode_steps) /
                                        max(1, len(decode_steps))),
        "stall_s": round(sum(s[3] for s in STEPS), 3),
    }


def run(policy: str, spec: str, config: EngineConfig) -> dict[str, Any]:
    STEPS.clear()
    PREEMPTS.clear()
    name, _, variant = policy.partition(":")
    variants = set(variant.split("+")) - {""}
    if unknown := variants - {"self", "gap"}:
        raise SystemExit(f"{policy}: unknown variant {sorted(unknown)} (known: self, gap)")
    make_room, due = planner._Planner.make_room, request.Request._due
    if "self" in variants:  # a running request short of blocks is preempted itself
        def own_room(self: Any, r: Any, need: int) -> None:
            if r.state != "running":
                make_room(self, r, need)

        planner._Planner.make_room = own_room  # type: ignore[method-assign]
    if "gap" in variants:  # §4.1 (6): a token is due TPOT after the last one was returned
        def gap_due(self: Any) -> float:
            if self.first_token_at is None or self.tpot_ms is None:
                return due(self)
            return self.last_token_at + self.tpot_ms / 1000.0

        request.Request._due = gap_due  # type: ignore[method-assign]
    workload = load_workload(spec)
    try:
        o = run_one(parse_policy(name), workload, config, progress=False,
                    clock_limit_s=20 * workload.duration_s)
    finally:
        planner._Planner.make_room = make_room  # type: ignore[method-assign]
        request.Request._due = due  # type: ignore[method-assign]
    if o.metrics is None:
        return {"policy": policy, "error": o.error}
    rt, be = o.metrics.by_class.get("rt", {}), o.metrics.by_class.get("be", {})
    a = rt.get("slo_attainment", {})
    out = {"policy": policy, "rt_ttft_ok": a.get("ttft"),
           # the engine's counts over every RT token after a request's first
           "tpot_ok_per_token_cumulative": a.get("tpot_per_token"),
           "tpot_ok_per_gap": a.get("tpot_per_gap"),
           "rt_norm_latency_ms": rt["normalized_latency_ms"]["mean"],
           "be_requests_per_s": be.get("requests_per_s", 0.0),
           "preemptions": o.metrics.preemptions, "copy_calls": o.metrics.swap.copy_ops,
           "copy_stall_s": round(o.metrics.swap.stall_s, 3), "wall_s": round(o.wall_s, 1),
           **analyse(o)}
    return out


def short(policy: str) -> str:
    return policy.split("/")[-1].replace(".policy", "")


def report(paths: list[Path]) -> str:
    out = ["| GPU, blocks, tokens | RT/s | seed | policy | RT TTFT ok | TPOT ok per request | per token "
           "(cumulative) | per gap | per gap, request mean | late gaps: preempted / left out "
           "(iterations) / long iteration / copy stall | late gap p50 / max ms | RT / BE "
           "preempted whole | BE req/s |", "|---" * 13 + "|"]
    for path in paths:
        for r in json.loads(path.read_text()):
            if "error" in r:
                out.append(f"| {r['num_blocks']} | {r['rate']:g} | {r['seed']} | "
                           f"{short(r['policy'])} | failed: {r['error']} |")
                continue
            g = r["late_gaps"]
            q = r["late_gap_p50_p99_max_ms"]
            out.append(" | ".join([
                f"| {r['profile'].split('-')[-1]}, {r['num_blocks']}, {r['max_batched_tokens']}",
                f"{r['rate']:g}",
                str(r["seed"]), short(r["policy"]), f"{100 * r['rt_ttft_ok']:.1f}%",
                f"{100 * r['tpot_ok_per_request']:.2f}%",
                f"{100 * r['tpot_ok_per_token_cumulative']:.2f}%",
                f"{100 * r['tpot_ok_per_gap']:.2f}%",
                f"{100 * r['tpot_ok_per_gap_request_mean']:.2f}%",
                (f"{g.get('preempted', 0)} / {g.get('left_out', 0)} "
                 f"({g.get('left_out_iterations', 0)}) / {g.get('long_iteration', 0)} / "
                 f"{g.get('copy_stall', 0)}"),
                f"{q[0]:.0f} / {q[2]:.0f}" if q else "-",
                f"{r['rt_preemptions']} / {r['be_preemptions']}",
                f"{r['be_requests_per_s']:.2f}"]) + " |")
    return "\n".join(out) + "\n\n" + ratios(paths)


def ratios(paths: list[Path]) -> str:
    """bros against each other policy of the same point and seed (`bros:V` against the others
    run with variant V, where there is one): TPOT attainment per gap
    (share of tokens; mean of each request's share), per token (cumulative), TTFT attainment
    and BE throughput, each as a ratio."""
    runs: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for path in paths:
        for r in json.loads(path.read_text()):
            if "error" not in r:
                key = (r["profile"], r["num_blocks"], r["max_batched_tokens"], r["rate"], r["seed"])
                runs.setdefault(key, {})[short(r["policy"])] = r
    out = ["| profile, blocks, tokens | RT/s | seed | policies | TPOT per gap | per gap, "
           "request mean | per token (cumulative) | TTFT | BE req/s |", "|---" * 9 + "|"]
    for (profile, blocks, tokens, rate, seed), by in runs.items():
        for name, o in by.items():
            base, _, variant = name.partition(":")
            # bros:V against the other policies run with the same variant V, else plain bros
            mine = f"bros:{variant}" if base != "bros" and f"bros:{variant}" in by else "bros"
            if name == mine or (b := by.get(mine)) is None:
                continue
            cells = [f"{b[k] / o[k]:.3f}x" if o[k] else "-" for k in (
                "tpot_ok_per_gap", "tpot_ok_per_gap_request_mean", "tpot_ok_per_token_cumulative",
                "rt_ttft_ok", "be_requests_per_s")]
            out.append(f"| {profile}, {blocks}, {tokens} | {rate:g} | {seed} | {mine} against "
                       f"{name} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="4,6,8,10,12,14")
    ap.add_argument("--seeds", default="9")
    ap.add_argument("--num-blocks", type=int, default=3500)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--profile", default="llama3-8b-a100")
    ap.add_argument("--policies", default="bros_no_bicache,bros")
    if (args := args_or_report(ap, report)) is None:
        return 0
    install()
    config = EngineConfig(backend="sim", profile=args.profile, num_blocks=args.num_blocks,
                          max_batched_tokens=args.max_batched_tokens,
                          max_num_seqs=args.max_num_seqs, max_queued_requests=100_000)
    out: list[dict[str, Any]] = []
    for seed in args.seeds.split(","):
        for rate in (float(r) for r in args.rates.split(",")):
            spec = f"rtbe:rate={rate},duration={args.duration:g},seed={seed}"
            for p in args.policies.split(","):
                row = {"rate": rate, "seed": int(seed), "spec": spec, **attrs.asdict(
                    config, filter=lambda a, v: a.name in (
                        "num_blocks", "max_batched_tokens", "max_num_seqs", "profile")),
                    **run(p, spec, config)}
                out.append(row)
                print(json.dumps(finite(row)), flush=True)
                if args.json:  # after every run: a long sweep keeps what it has
                    args.json.write_text(json.dumps(finite(out), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
