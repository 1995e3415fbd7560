"""The bidirectional KV cache's own gain (BROS §7.4.1: 1.23x RT TTFT, 1.63x TPOT attainment) per
point and seed, from `bench/bros_bicache_counts.py --json` files that ran `bros`,
`bros_no_bicache` and the waiting ablation (`bench/bros_no_bicache_no_displace.policy`) on the
same arrivals; and where the gain comes from: how much of the pool RT holds and how often
packing found no memory for an RT request (issue 14, round 8:
bench/results/bros_bicache_round8.md).

    python bench/bros_bicache_gains.py FILE.json ...        # one markdown table, then means

A point is (profile, blocks, sequence cap, token budget, RT rate); its seeds are averaged in the
second table (gains as the mean of per-seed ratios).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

NAMES = {"bros": "bros", "bros_no_bicache": "nobi", "bros_no_bicache_no_displace": "wait"}


def _name(policy: str) -> str:
    return NAMES.get(Path(policy).name.removesuffix(".policy"), policy)


def load(paths: list[Path]) -> list[dict[str, Any]]:
    """One record per (file, point): the three policies' rows by short name."""
    out = []
    for path in paths:
        points: dict[tuple[Any, ...], dict[str, Any]] = defaultdict(dict)
        for r in json.loads(path.read_text()):
            seed = re.search(r"seed=(\d+)", r["spec"])
            key = (r["profile"], r["num_blocks"], r.get("max_num_seqs", 64),
                   r["max_batched_tokens"], r["rate"], int(seed.group(1)) if seed else None)
            points[key][_name(r["policy"])] = r
        out += [{"key": k[:-1], "seed": k[-1], **v} for k, v in points.items()
                if "bros" in v and "nobi" in v]
    return out


def _skips(r: dict[str, Any]) -> int:
    c = r["counts"]
    return c.get("pack_rt_memory_skip_waiting", 0) + c.get("pack_rt_memory_skip_running", 0)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def rows(points: list[dict[str, Any]]) -> str:
    out = ["| profile, blocks, seqs, tokens | RT/s | seed | RT share of pool (nobi / bros) | "
           "RT memory skips nobi / wait / bros | RT TTFT ok bros / nobi / wait | TTFT gain vs "
           "nobi (vs wait) | TPOT per token bros / nobi | BE req/s bros / nobi / wait | "
           "recompute RT / BE: nobi, bros | RT norm. latency ms bros / nobi |",
           "|---" * 10 + "|"]
    for p in sorted(points, key=lambda p: (p["key"], p["seed"] or 0)):
        b, n, w = p["bros"], p["nobi"], p.get("wait")
        prof, nb, seqs, tok, rate = p["key"]
        share = [x["pool"].get("mean_rt_blocks", 0) / nb for x in (n, b)]
        c = [x["counts"] for x in (n, b)]
        out.append(" | ".join([
            f"| {prof}, {nb}, {seqs}, {tok}", f"{rate:g}", str(p["seed"]),
            f"{100 * share[0]:.0f}% / {100 * share[1]:.0f}%",
            f"{_skips(n):,} / {_skips(w) if w else '-':,} / {_skips(b):,}",
            f"{100 * b['rt_ttft_ok']:.1f}% / {100 * n['rt_ttft_ok']:.1f}% / "
            + (f"{100 * w['rt_ttft_ok']:.1f}%" if w else "-"),
            f"{_ratio(b['rt_ttft_ok'], n['rt_ttft_ok']):.3f}x"
            + (f" ({_ratio(b['rt_ttft_ok'], w['rt_ttft_ok']):.3f}x)" if w else ""),
            f"{100 * b['rt_tpot_ok_per_token']:.2f}% / {100 * n['rt_tpot_ok_per_token']:.2f}%",
            f"{b['be_requests_per_s']:.2f} / {n['be_requests_per_s']:.2f} / "
            + (f"{w['be_requests_per_s']:.2f}" if w else "-"),
            f"{c[0].get('recompute_preempt_rt', 0)} / {c[0].get('recompute_preempt_be', 0)}, "
            f"{c[1].get('recompute_preempt_rt', 0)} / {c[1].get('recompute_preempt_be', 0)}",
            f"{b['rt_norm_latency_ms']:.1f} / {n['rt_norm_latency_ms']:.1f}"]) + " |")
    return "\n".join(out) + "\n"


def means(points: list[dict[str, Any]]) -> str:
    by: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        by[p["key"]].append(p)
    out = ["| profile, blocks, seqs, tokens | RT/s | seeds | RT share of pool, nobi | TTFT gain "
           "vs nobi: mean (range) | vs wait: mean (range) | TPOT per token gain vs nobi | BE "
           "gain vs nobi |", "|---" * 8 + "|"]
    for key in sorted(by):
        ps = by[key]
        g = [_ratio(p["bros"]["rt_ttft_ok"], p["nobi"]["rt_ttft_ok"]) for p in ps]
        gw = [_ratio(p["bros"]["rt_ttft_ok"], p["wait"]["rt_ttft_ok"]) for p in ps if "wait" in p]
        t = [_ratio(p["bros"]["rt_tpot_ok_per_token"], p["nobi"]["rt_tpot_ok_per_token"])
             for p in ps]
        be = [_ratio(p["bros"]["be_requests_per_s"], p["nobi"]["be_requests_per_s"]) for p in ps]
        share = sum(p["nobi"]["pool"].get("mean_rt_blocks", 0) for p in ps) / len(ps) / key[1]

        def fmt(xs: list[float]) -> str:
            return f"{sum(xs) / len(xs):.3f}x ({min(xs):.3f}-{max(xs):.3f})" if xs else "-"
        out.append(" | ".join([
            f"| {key[0]}, {key[1]}, {key[2]}, {key[3]}", f"{key[4]:g}",
            ", ".join(str(p["seed"]) for p in sorted(ps, key=lambda p: p["seed"] or 0)),
            f"{100 * share:.0f}%", fmt(g), fmt(gw), fmt(t), fmt(be)]) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", type=Path, nargs="+")
    args = ap.parse_args()
    points = load(args.files)
    print(rows(points))
    print(means(points), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
