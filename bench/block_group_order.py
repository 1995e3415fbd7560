"""Which group does the block-group allocator hand out when no free group matches the size
wanted (issue 13, defect 2)? Measured both ways on the simulator:

- `split_tails=True` (kept, FastSwitch §3.1: "prioritizes fulfilling requests from the Free Block
  Group Manager first and then from the Used Block Group Manager if necessary"): a free group
  that holds the size wanted; else the spare tail of another request's active group, when that
  is longer than the longest free group; else the longest free group;
- `split_tails=False` (before): any free group, however short, before any split.

Reported: blocks per swap copy, groups a request's KV is in when it is swapped, groups handed
out shorter than wanted, splits, free runs (fragmentation) at each new group.

    python bench/block_group_order.py   # -> bench/results/block_group_order.json
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import structlog

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.memory import block_groups
from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.workloads import load_workload

WORKLOAD = "multiturn:conversations=30,rate=0.2,seed=1"
CONFIG = EngineConfig(backend="sim", profile="llama3-8b-a10", cpu_swap_blocks=28610,
                      max_num_seqs=64, max_batched_tokens=2048, max_queued_requests=100_000)


def measure(split_tails: bool) -> dict:
    stats = {"new_groups": 0, "short": 0, "splits": 0, "free_runs": 0}
    manager = block_groups.BlockGroupManager
    original_init, original_new, original_split = (manager.__init__, manager._new_group,
                                                   manager._split)

    def init(self, block_ids, **kw):
        original_init(self, block_ids, **{**kw, "split_tails": split_tails})

    def new_group(self, request_id, need):
        target = max(need, self._target_size(request_id))
        stats["free_runs"] += len(self._free)
        group = original_new(self, request_id, need)
        stats["new_groups"] += 1
        stats["short"] += group.reserved < target
        return group

    def split(donor, want):
        stats["splits"] += 1
        return original_split(donor, want)

    manager.__init__, manager._new_group = init, new_group
    manager._split = staticmethod(split)
    try:
        o = run_one(parse_policy("groups_markov"), load_workload(WORKLOAD), CONFIG, progress=False)
    finally:
        manager.__init__, manager._new_group = original_init, original_new
        manager._split = staticmethod(original_split)
    s = o.metrics.swap
    blocks = s.blocks_out + s.blocks_in
    return {"split_tails": split_tails, "blocks_per_copy": blocks / s.copy_ops,
            "blocks_per_run": blocks / s.runs, "new_groups": stats["new_groups"],
            "shorter_than_wanted": stats["short"], "splits": stats["splits"],
            "mean_free_runs": stats["free_runs"] / max(1, stats["new_groups"]),
            "ttft_p99_ms": o.metrics.ttft_ms.p99, "output_tokens_per_s": o.metrics.output_tokens_per_s}


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    results = {"workload": WORKLOAD, "profile": CONFIG.profile, "policy": "groups_markov",
               "runs": [measure(True), measure(False)]}
    out = ROOT / "bench" / "results" / "block_group_order.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
