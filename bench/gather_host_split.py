"""BROS's host space split (round 10, second part): an engine started with `bidirectional on` and
`preempt swap` sets aside twice the device's blocks on the host (shunter/engine.py
`_host_blocks`), the first half as the lazy checkpoints' slot space (engine/memory/host_slots.py)
and the second as the whole-request copy space (engine/memory/slot_swap.py `HostBlocks`). Here
the same total is split other ways: `--splits` gives the copy space's share of it (0.5 is the
default engine); `both` gives each space the whole total (twice the host memory: the bound on
what any sharing of one pool could gain, since no shared pool can give either side more).

Per run, beside bench/gather_round10.py's columns: the victims the planner picked that the copy
space refused (`refused`: they were recomputed instead), the requests the fit's own extreme case
recomputed (`make_room_recomputed`), those swapped out whole, the fits that found the checkpoint
space with less than a block's slots free (`ckpt_full_fits`: an RT decode into a BE slot then
cannot extend) and each space's peak use.

    python bench/gather_host_split.py --points 1500:10 --seeds 9 --splits 0.5,0.25 --json OUT
    python bench/gather_host_split.py --report OUT...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gather_round10 as g  # noqa: E402
from bench.bros_bicache_counts import args_or_report  # noqa: E402
from engine import bidirectional_step  # noqa: E402
from shunter import EngineConfig  # noqa: E402

SPLIT: dict[str, Any] = {"share": "0.5", "refused": 0, "fits": 0, "ckpt_full": 0,
                         "ckpt_peak": 0, "copy_peak": 0, "sizes": (0, 0)}


def resplit(share: str, block_size: int, host_slots: int, copy_blocks: range | None
            ) -> tuple[int, range | None]:
    """The engine's two spaces (`host_slots` slots, `copy_blocks`) split again: the copy space
    gets `share` of their blocks (`both`: each gets all of them)."""
    total = host_slots // block_size + (len(copy_blocks) if copy_blocks is not None else 0)
    if copy_blocks is None:
        return host_slots, None
    if share == "both":
        return total * block_size, range(total, 2 * total)
    whole = round(total * float(share))
    if not 0 < whole < total:
        raise ValueError(f"--splits {share}: each space needs a block ({total} in all)")
    return (total - whole) * block_size, range(total - whole, total)


def install() -> None:
    g.install()
    init, swap_out, fit = (bidirectional_step.BidirectionalMemory.__init__,
                           bidirectional_step.BidirectionalMemory.swap_out,
                           bidirectional_step.BidirectionalMemory.fit)

    def split_init(self: Any, block_ids: range, block_size: int, host_slots: int,
                   copy_blocks: range | None = None, **kwargs: Any) -> None:
        slots, blocks = resplit(SPLIT["share"], block_size, host_slots, copy_blocks)
        SPLIT["sizes"] = (slots, len(blocks) if blocks is not None else 0)
        init(self, block_ids, block_size, slots, blocks, **kwargs)

    def counted_swap_out(self: Any, rid: int) -> bool:
        done = swap_out(self, rid)
        if not done and self.table.has_copy_space and rid in self.table and self.table.tokens(rid):
            SPLIT["refused"] += 1
        return done

    def watched_fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = fit(self, *args, **kwargs)
        t, (slots, blocks) = self.table, SPLIT["sizes"]
        SPLIT["fits"] += 1
        SPLIT["ckpt_full"] += t.free_host_slots < t.block_size
        SPLIT["ckpt_peak"] = max(SPLIT["ckpt_peak"], slots - t.free_host_slots)
        SPLIT["copy_peak"] = max(SPLIT["copy_peak"], blocks - t.free_copy_blocks)
        return out

    bidirectional_step.BidirectionalMemory.__init__ = split_init  # type: ignore[method-assign]
    bidirectional_step.BidirectionalMemory.swap_out = counted_swap_out  # type: ignore[method-assign]
    bidirectional_step.BidirectionalMemory.fit = watched_fit  # type: ignore[method-assign]


def run(share: str, spec: str, config: EngineConfig) -> dict[str, Any]:
    SPLIT.update(share=share, refused=0, fits=0, ckpt_full=0, ckpt_peak=0, copy_peak=0)
    row = g.run("gather", spec, config)
    mem = g.STATE["tables"][-1]
    slots, blocks = SPLIT["sizes"]
    return {"split": share, **row, "ckpt_slots": slots, "copy_blocks": blocks,
            "refused": SPLIT["refused"], "make_room_recomputed": mem.recomputed,
            "swapped_out": mem.swapped_out, "victims_swapped": mem.victims_swapped,
            "fits": SPLIT["fits"], "ckpt_full_fits": SPLIT["ckpt_full"],
            "ckpt_peak_share": round(SPLIT["ckpt_peak"] / max(slots, 1), 3),
            "copy_peak_share": round(SPLIT["copy_peak"] / max(blocks, 1), 3)}


def report(paths: list[Path]) -> str:
    rows = [r for p in paths for r in json.loads(p.read_text())]
    out = ["| blocks / RT/s | seed | copy share | ckpt slots / copy blocks | ckpt full fits "
           "| ckpt peak | copy peak | swapped out (victims) | refused | make_room recomputed "
           "| RT TTFT ok | RT norm. latency ms | BE req/s | completed, failed |", "|---" * 14 + "|"]
    for r in rows:
        out.append(" | ".join([
            f"| {r['num_blocks']:,} / {r['rate']:g}", str(r["seed"]), r["split"],
            f"{r['ckpt_slots']:,} / {r['copy_blocks']:,}",
            f"{r['ckpt_full_fits']:,} of {r['fits']:,}", f"{100 * r['ckpt_peak_share']:.0f}%",
            f"{100 * r['copy_peak_share']:.0f}%",
            f"{r['swapped_out']:,} ({r['victims_swapped']:,})", f"{r['refused']:,}",
            f"{r['make_room_recomputed']:,}", f"{100 * r['rt_ttft_ok']:.1f}%",
            f"{r['rt_norm_latency_ms']:.1f}", f"{r['be_requests_per_s']:.2f}",
            f"{r['completed']:,}, {r['failed']}"]) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g.point_args(ap)
    ap.add_argument("--splits", default="0.5,0.25,0.75,both")
    if (args := args_or_report(ap, report)) is None:
        return 0
    install()
    g.sweep(args, args.splits.split(","), run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
