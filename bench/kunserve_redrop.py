"""A growing KunServe group's weight copies on torch (gpu/group_grow.py `redrop_layers`): a
member that keeps other layers copies only the layers it gains (from its host copy) and those it
drops now (to the host), against restoring its whole model from the host copy and dropping again
(the first version of the growth). One process, no data plane: only the member's own copies.

    python bench/kunserve_redrop.py [--rounds 8] [--layers 8] [--hidden 512]

A group of two (layers split in half) grows to three (`stage_layers`): each old member's move,
the head's (0..L/2 -> its new first stage) and member 1's (L/2..L -> the middle stage), is timed
both ways, interleaved, the model restored and dropped to its old range again (untimed) between
rounds. Medians of wall time and the bytes each way copies. Writes
bench/results/kunserve_redrop.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "kunserve_redrop.json"))
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.layers < 3:
        p.error("--layers must be >= 3 (a group of three needs a layer per stage)")
    if args.hidden < 16 or args.hidden % 16:
        p.error("--hidden must be a multiple of 16")
    return args


def main(argv=None) -> dict:
    import torch

    from engine.cluster.plan import stage_layers
    from gpu.group_grow import redrop_layers
    from gpu.make_model import write_random_model
    from gpu.model import CausalLM
    from gpu.stage_view import drop_layers, restore_layers

    args = parse_args(argv)
    torch.set_num_threads(1)
    d = write_random_model(tempfile.mkdtemp(prefix="redrop-"), arch="llama", layers=args.layers,
                           hidden=args.hidden, heads=8, kv_heads=4, vocab=1024, seed=1)
    model = CausalLM.from_pretrained(d, num_kv_blocks=16, block_size=16)
    two, three = stage_layers(args.layers, 2), stage_layers(args.layers, 3)
    rows = {}
    for who, old, new in (("head", two[0], three[0]), ("member 1", two[1], three[1])):
        times = {"incremental": [], "full": []}
        copied = {}
        for r in range(args.rounds):
            for way in (("incremental", "full") if r % 2 == 0 else ("full", "incremental")):
                drop_layers(model, old)
                began = time.perf_counter()
                if way == "incremental":
                    _, back, out = redrop_layers(model, new)
                else:
                    back = sum(t.numel() * t.element_size()
                               for t in model.drop_state.host_copy.values())
                    restore_layers(model)
                    out = drop_layers(model, new).freed_bytes
                times[way].append(time.perf_counter() - began)
                copied[way] = back + out
                restore_layers(model)
        inc, full = (statistics.median(times[w]) for w in ("incremental", "full"))
        rows[who] = {"from": [old.start, old.stop], "to": [new.start, new.stop],
                     "copied_bytes": copied, "median_s": {"incremental": inc, "full": full},
                     "full_over_incremental": full / inc if inc else None}
        print(f"{who}: layers {old.start}-{old.stop - 1} -> {new.start}-{new.stop - 1}: copied "
              f"{copied['incremental'] / 2**20:.2f} MiB vs {copied['full'] / 2**20:.2f} MiB "
              f"(restore whole + drop again); {inc * 1e3:.2f} ms vs {full * 1e3:.2f} ms "
              f"(x{full / inc:.2f})")
    out = {"layers": args.layers, "hidden": args.hidden, "rounds": args.rounds, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
