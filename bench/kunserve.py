"""KunServe (issue 16) on the simulator: N instances of Llama-3-8B on one virtual clock, a
window of the azure-code trace, the KunServe ladder against the KV-centric baselines.

    python bench/kunserve.py [--rate 1x] [--start 780] [--duration 180] [--instances 4]

Runs (the same arrivals for each):
- `vllm_dp`: every instance alone, FCFS, preemption by recompute (vLLM's default; the
  dispatcher is least_load, as KunServe's own, so only memory handling differs);
- `infercept_swap`: the same with preemption by swap to host memory (InferCept-style);
- `pipeline2`: a static 2-stage pipeline: N/2 groups of two instances formed from the start (the
  same cross-iteration pipeline model as KunServe's groups, sim/group.py, microbatches by
  tokens), each with the pool of two instances plus one freed weight copy (vLLM PP);
- the ladder `kunserve_drop` -> `kunserve_exchange` -> `kunserve_lookahead` -> `kunserve`.

Reports P50/P99 TTFT, P50/P99 TPOT, SLO violations (a request violates when its TTFT exceeds 5x
the best baseline's P50 TTFT, the paper's scale factor for chat, §5.2), throughput, and for
KunServe runs the cluster block (drops, restores, groups, exchanged bytes, bubble ratio, the
Eq. 1-3 model's error). The mean memory demand of the window (KV of the requests in the system,
queued or running, over the cluster's KV capacity) is computed from the vllm_dp run. Writes
bench/results/kunserve_sim.{json,md} and a timeline plot of the burst when matplotlib is there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import anyio
import attrs
import trio
import trio.testing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kunserve_ladder import ladder, ladder_lines
from bench.kunserve_plot import plot
from bench.kunserve_trace import add_trace_args, merge_report, sim_instance, trace_workload
from engine.cluster.drop_plan import GroupPlan, group_pool
from engine.cluster.plan import stage_layers
from engine.config import EngineConfig
from policies import policy_path
from shunter.benchmark.driver import Driver
from shunter.benchmark.run import replay_task_order_exactly
from shunter.cluster.cluster import Cluster
from sim.arena_layout import freed_blocks
from sim.group import GroupNetwork, SimGroup
from sim.network import LINKS
from sim.profile import load_profile

BASELINE_POLICIES = {
    "vllm_dp": "policy vllm_dp extends \"fcfs.policy\" {\n  dispatch least_load\n}\n",
    "infercept_swap": "policy infercept_swap extends \"fcfs.policy\" {\n  dispatch least_load\n"
                      "  preempt swap\n}\n",
    "pipeline2": "policy pipeline2 extends \"fcfs.policy\" {\n  dispatch least_load\n}\n",
}
LADDER = ["kunserve_drop", "kunserve_exchange", "kunserve_lookahead", "kunserve"]
RUN_LABELS = [*BASELINE_POLICIES, *LADDER, "memory_oracle"]  # in the order they run
CHAIN = False
"""--chain: a prompt cut across microbatches holds its group's step until its last piece is
through (sim/group.py `GroupNetwork.chain`; the bound on pipelines' first tokens)."""
EQ1_AS_PUBLISHED = False
"""--eq1-as-published: lookahead splits by Eq. 1 with one prefix-attention coefficient for
decodes and prefills alike (sim/group.py `GroupNetwork.decode_term`)."""
MONITOR_INTERVAL_S = 0.05  # the cluster monitor's round (bench/kunserve_restore.py varies it)


async def sample_demand(cluster, capacity_blocks: int, block_size: int, out: list) -> None:
    """Every 0.5 s: the cluster's KV held, held plus each instance's head-of-line request (the
    memory demand as Llumnix counts it and KunServe §2.2 uses to scale traces), and held plus
    every queued request, each over the pre-drop capacity."""
    while True:
        held = head = queued = 0
        for i in range(len(cluster.instances)):
            st = cluster.table.stats(i)
            if st is None:
                continue
            held += st.total_blocks - st.free_blocks
            head += -(-st.head_tokens // block_size)
            queued += -(-st.queued_tokens // block_size)
        out.append((anyio.current_time(), held / capacity_blocks,
                    (held + head) / capacity_blocks, (held + queued) / capacity_blocks))
        await anyio.sleep(0.5)


def static_pair_blocks(model, one: int, block_size: int) -> int:
    """The static pipeline's pool: two instances' pools and what the pair frees, as a KunServe
    pair's (one copy of the decoder layers in arena blocks, sim/arena_layout.py, as torch frees
    them; until round 13 the whole weights' bytes, 7,658 blocks of Llama-3-8B where the pair
    frees 6,688: the embeddings, LM head and final norm stay on both members)."""
    return group_pool([one, one], freed_blocks(model, block_size))


async def serve(label: str, policy_file: Path, workload, base: EngineConfig, instances: int):
    config = attrs.evolve(base, policy=policy_file)
    static = label == "pipeline2"
    profile = load_profile(base.profile)
    one = base.num_blocks or profile.num_blocks(base.block_size)
    capacity = instances * one
    if label == "memory_oracle":  # vllm_dp with 16x the KV: what no memory mechanism can beat
        config = attrs.evolve(config, num_blocks=16 * one)
    if static:  # N/2 instances, each the head of a fixed two-member group
        # as a KunServe group (engine/cluster/adoption.py `GroupSeat.stages`): each of the
        # 2 stages an instance's token budget, the group one instance's sequences
        config = attrs.evolve(config, num_blocks=static_pair_blocks(profile.model, one,
                                                                    base.block_size),
                              max_batched_tokens=2 * base.max_batched_tokens)
        instances //= 2
    demand: list = []
    async with Cluster.start(config, instances=instances, kind="inprocess",
                             monitor_interval_s=MONITOR_INTERVAL_S) as cluster:
        if cluster.groups is not None:
            for net in cluster.groups.networks():
                net.decode_term = not EQ1_AS_PUBLISHED
                net.chain = CHAIN
        if static:
            model = load_profile(base.profile).model
            plan = GroupPlan(group_id=0, members=(0, 1), layers=stage_layers(model.num_layers, 2))
            for inst in cluster.instances:
                runner = inst.engine.backend.runner
                runner.network = GroupNetwork(link=LINKS[base.pipeline_link], model=model,
                                              chain=CHAIN)
                runner.group = SimGroup(plan, runner.cost, runner.network, runner.token_id)
        driver = Driver(cluster, workload, vocab=cluster.backend.vocab_size,
                        declared_classes={"default"})
        async with anyio.create_task_group() as tg:
            tg.start_soon(sample_demand, cluster, capacity, base.block_size, demand)
            result = await driver.run()
            tg.cancel_scope.cancel()
        report = cluster.groups.report(result.started) if cluster.groups is not None else None
        if static:
            nets = [i.engine.backend.runner.network for i in cluster.instances]
            busy = sum(n.totals.busy_s for n in nets)
            stage = sum(n.totals.stage_s for n in nets)
            report = {"bubble_ratio": 1 - busy / stage if stage else 0.0,
                      "chain_bound_steps": sum(n.chain_steps for n in nets),
                      "chain_extra_s": sum(n.chain_extra_s for n in nets)}
    return result, report, demand


def run(label: str, policy_file: Path, workload, base: EngineConfig, instances: int):
    began = time.perf_counter()
    with replay_task_order_exactly():  # the same order in a script and under pytest
        result, cluster, demand = anyio.run(serve, label, policy_file, workload, base,
                                            instances, backend="trio",
                                            backend_options={"clock": trio.testing.MockClock(
                                                autojump_threshold=0)})
    return result, cluster, demand, time.perf_counter() - began


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] if xs else float("nan")


def summarize(result, slo_s: float | None) -> dict:
    tl = result.timelines
    ttft = [t.ttft_s for t in tl if t.ttft_s is not None]
    tpot = [t.tpot_s for t in tl if t.tpot_s is not None]
    out_tokens = sum(t.output_tokens for t in tl)
    dur = result.finished - result.started
    s = {"requests": len(tl), "failed": len(result.failed),
         "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "ttft_max_s": max(ttft),
         "tpot_p50_ms": pct(tpot, 50) * 1e3, "tpot_p99_ms": pct(tpot, 99) * 1e3,
         "throughput_tok_s": out_tokens / dur if dur > 0 else 0.0,
         "finish_reasons": sorted({t.finish_reason for t in tl})}
    if slo_s is not None:
        s["slo_ttft_s"] = slo_s
        s["slo_violations"] = sum(1 for t in ttft if t > slo_s) / max(1, len(ttft))
    return s


def memory_demand(result, capacity_tokens: int) -> float:
    """Mean KV demand over the window: every request's context (prompt + output) for as long
    as it is in the system (queued or running), over the cluster's capacity."""
    dur = result.finished - result.started
    demand = sum((t.prompt_tokens + t.output_tokens) * t.e2e_s for t in result.timelines)
    return demand / dur / capacity_tokens if dur > 0 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_args(ap, trace="azure-code", start=780.0, duration=180.0,
                   traces=["azure-code", "azure-conv", "mooncake-conv"])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks per instance (default: what the profile's GPU leaves)")
    ap.add_argument("--eq1-as-published", action="store_true",
                    help="lookahead without the decode term (Eq. 1 exactly as the paper)")
    ap.add_argument("--chain", action="store_true",
                    help="a prompt cut across a group's microbatches holds the step until its "
                         "last piece is through (pipelines' first tokens exact, throughput a "
                         "lower bound; default: the steady-state period)")
    ap.add_argument("--profile", default="llama3-8b-a10")
    ap.add_argument("--link-scale", type=float, default=1.0,
                    help="multiply the pipeline link's bandwidth (KV exchange and activations; "
                         "a100-internode: 7.83 GB/s from Vidur's send_recv profile, sim/network.py)")
    ap.add_argument("--only", default="", help="comma-separated run labels (default: all)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kunserve_sim"))
    ap.add_argument("--merge", action="store_true", help="re-run only --only's runs into "
                    "--out's .json, keeping its other runs (and their SLO and demand)")
    ap.add_argument("--table-only", action="store_true",
                    help="rewrite the .md table and the plot from the .json of --out")
    args = ap.parse_args()
    unknown = [x for x in args.only.split(",") if x and x not in RUN_LABELS] if args.only else []
    if unknown:  # (before: nothing ran, then the table failed on an empty report)
        ap.error(f"--only: no run named {', '.join(map(repr, unknown))} "
                 f"(runs: {', '.join(RUN_LABELS)})")
    if args.table_only:
        out = Path(args.out)
        report = json.loads(out.with_suffix(".json").read_text())
        out.with_suffix(".md").write_text(table(report))
        plot(report, out.with_suffix(".png"))
        return
    spec, workload = trace_workload(args)
    base = sim_instance(args.profile, args.num_blocks or None)
    profile = load_profile(args.profile)
    if args.link_scale != 1.0:  # this process only: every run of the bench sees the same link
        link = LINKS[base.pipeline_link]
        LINKS[base.pipeline_link] = attrs.evolve(link, bytes_per_s=link.bytes_per_s * args.link_scale)
    global EQ1_AS_PUBLISHED, CHAIN
    EQ1_AS_PUBLISHED = args.eq1_as_published
    CHAIN = args.chain
    capacity = args.instances * (args.num_blocks or profile.num_blocks(base.block_size)) \
        * base.block_size
    policy_dir = Path(args.out).parent / "kunserve_policies"
    policy_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for label, text in BASELINE_POLICIES.items():
        path = policy_dir / f"{label}.policy"
        path.write_text(text.replace('"fcfs.policy"', f'"{policy_path("fcfs")}"'))
        runs.append((label, path))
    runs += [(name, policy_path(name)) for name in LADDER]
    runs.append(("memory_oracle", policy_dir / "vllm_dp.policy"))
    if args.only:
        keep = set(args.only.split(","))
        runs = [r for r in runs if r[0] in keep]
    results = {}
    for label, path in runs:
        result, cluster, demand, wall = run(label, path, workload, base, args.instances)
        results[label] = (result, cluster, demand, wall)
        print(f"{label}: {len(result.timelines)} requests, wall {wall:.1f} s", flush=True)
    base_p50 = min(pct([t.ttft_s for t in results[b][0].timelines], 50)
                   for b in BASELINE_POLICIES if b in results) if any(
        b in results for b in BASELINE_POLICIES) else None
    slo = 5 * base_p50 if base_p50 is not None else None
    old = json.loads(Path(args.out).with_suffix(".json").read_text()) if args.merge else None
    if old is not None and slo is None:
        slo = next(iter(old["runs"].values())).get("slo_ttft_s")
    report = {"workload": spec, "profile": args.profile, "instances": args.instances,
              "link": base.pipeline_link,
              "link_gb_per_s": LINKS[base.pipeline_link].bytes_per_s / 1e9,
              "engine": {k: getattr(base, k) for k in ("max_num_seqs", "max_batched_tokens",
                                                       "cpu_swap_blocks", "num_blocks")},
              "eq1_as_published": EQ1_AS_PUBLISHED, "chain": CHAIN,
              "capacity_tokens": capacity, "runs": {}}
    if "vllm_dp" in results:
        report["mean_kv_in_system"] = memory_demand(results["vllm_dp"][0], capacity)
        report.update(demand_summary(results["vllm_dp"][2]))
    for label, (result, cluster, demand, wall) in results.items():
        entry = summarize(result, slo)
        entry["wall_s"] = wall
        entry["code"] = code_version()
        entry["demand"] = demand_summary(demand)
        if cluster is not None:
            entry["cluster"] = cluster
        if label == "kunserve":  # (the plot marks its threshold)
            from bench.kunserve_restore import shipped_rule
            entry["restore_rule"] = shipped_rule()
        if label in ("vllm_dp", "kunserve"):
            entry["ttft_series"] = sorted(
                (round(t.arrival - result.started, 3), round(t.ttft_s, 3))
                for t in result.timelines if t.ttft_s is not None)
        report["runs"][label] = entry
    if old is not None:
        report = merge_report(old, report)
    report["ladder"] = ladder(report["runs"])
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(table(report))
    print(table(report))
    plot(report, out.with_suffix(".png"))


def code_version() -> str:
    """The commit the run's code is ("+": tracked files differ; $KUNSERVE_CODE: a snapshot's)."""
    import os
    import subprocess
    head, dirty = (subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
                   .stdout.strip() for a in (("rev-parse", "--short", "HEAD"),
                                             ("status", "--short", "-uno")))
    return os.environ.get("KUNSERVE_CODE") or head + ("+" if dirty else "")


def demand_summary(samples: list) -> dict:
    """Means and peaks of the sampled demand (`sample_demand`), as shares of the capacity."""
    if not samples:
        return {}
    n = len(samples)
    return {"mean_memory_demand": sum(s[2] for s in samples) / n,
            "mean_kv_held": sum(s[1] for s in samples) / n,
            "peak_memory_demand": max(s[2] for s in samples),
            "peak_demand_with_queue": max(s[3] for s in samples),
            "share_of_time_queue_over_capacity": sum(s[3] > 1 for s in samples) / n,
            "share_of_time_head_blocked": sum(s[2] > 1 for s in samples) / n}


def oracle_line(runs: dict) -> str:
    """The workload's own KV demand: what the memory oracle held (no memory limit, so no
    baseline's backlog inflates it), over the capacity the cluster has."""
    d = (runs.get("memory_oracle") or {}).get("demand")
    if not d:
        return ""
    return (f"The workload's own demand (KV the memory oracle held, over the same capacity): "
            f"mean {d['mean_kv_held']:.1%}, peak {d['peak_memory_demand']:.1%}, over capacity "
            f"{d['share_of_time_head_blocked']:.1%} of the time.\n")


def table(report: dict) -> str:
    runs = report["runs"]
    kv = [r for r in ("vllm_dp", "infercept_swap") if r in runs]  # KV-centric (§2.3)
    best = min(kv, key=lambda r: runs[r]["ttft_p99_s"]) if kv else None
    lines = [(f"# KunServe on the simulator: {report['workload']}, {report['instances']} x "
             f"{report['profile']}, link {report['link']}"
             + (f" ({report['link_gb_per_s']:.2f} GB/s)" if "link_gb_per_s" in report else "")
             + (" (--chain: cut prompts hold their group's step)" if report.get("chain") else "")),
             "",
             (f"Memory demand on vllm_dp (KV held plus each instance's head-of-line request, "
             f"as Llumnix counts it; sampled every 0.5 s) over {report['capacity_tokens']:,} "
             f"KV tokens: mean {report.get('mean_memory_demand', float('nan')):.1%}, peak "
             f"{report.get('peak_memory_demand', float('nan')):.1%}; with every queued request "
             f"counted, peak {report.get('peak_demand_with_queue', float('nan')):.1%}, over "
             f"capacity {report.get('share_of_time_queue_over_capacity', float('nan')):.1%} of "
             f"the time; head-of-line request blocked by memory "
             f"{report.get('share_of_time_head_blocked', float('nan')):.1%} of the time. "
             f"memory_oracle = vllm_dp with 16x the KV (no memory limit): no memory mechanism "
             f"can beat it. SLO: TTFT <= "
             f"{runs[next(iter(runs))].get('slo_ttft_s', float('nan')):.2f} s (5x the best "
             f"baseline's P50). Best KV-centric baseline by P99 TTFT: {best} (pipeline2, vLLM's "
             f"static pipeline, keeps parameters dropped all the time: listed, not counted "
             f"as KV-centric)."),
             "",
             oracle_line(runs),
             ("| run | P50 TTFT s | P99 TTFT s | P99 vs best | P50 TPOT ms | P99 TPOT ms | SLO viol. "
             "| tok/s | drops | restores | groups | KV exchanged GB | bubble |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in runs.items():
        c = r.get("cluster") or {}
        ratio = runs[best]["ttft_p99_s"] / r["ttft_p99_s"] if best else float("nan")
        lines.append(
            f"| {label} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {ratio:.2f}x | "
            f"{r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | "
            f"{r.get('slo_violations', float('nan')):.1%} | {r['throughput_tok_s']:.0f} | "
            f"{c.get('drops', '')} | {c.get('restores', '')} | {c.get('groups_formed', '')} | "
            f"{c['kv_exchanged_bytes'] / 1e9:.2f} | " if 'kv_exchanged_bytes' in c else
            f"| {label} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {ratio:.2f}x | "
            f"{r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | "
            f"{r.get('slo_violations', float('nan')):.1%} | {r['throughput_tok_s']:.0f} | "
            f" |  |  |  | ")
        lines[-1] += f"{c['bubble_ratio']:.3f} |" if "bubble_ratio" in c else " |"
    fit = [(k, r["cluster"]["cost_model_error"], r["cluster"]["token_model_error"])
           for k, r in runs.items() if (r.get("cluster") or {}).get("cost_model_error")]
    if fit:
        lines += ["", "Eq. 1-3 cost model, least squares per stage, mean relative error on "
                  "held-out microbatches (vs a token-count model fitted the same way): "
                  + "; ".join(f"{k}: {e:.2%} (tokens: {t:.2%})" for k, e, t in fit) + "."]
    lines += ladder_lines(report.get("ladder") or ladder(runs))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
