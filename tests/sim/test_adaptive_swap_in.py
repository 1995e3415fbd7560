"""Issue 13, defect 3 (FastSwitch §3.2): adaptive swap-in must pick synchronous where that wins
and asynchronous where that wins. Two workloads on the simulator (A10 profile, block groups,
random priorities re-drawn often), each run three ways; which mode wins is measured here, then
adaptive must have chosen it for most swap-ins and come within 3% of the winner's throughput.

- many short requests (64 prompt + 64 output tokens) over PCIe 4.0: a swap-in takes a fraction
  of a millisecond, and an asynchronous one costs its request an iteration: synchronous wins;
- a few long requests among many short ones over a 1 GB/s link: a swap-in takes a second, which
  a synchronous one stalls every running request for: asynchronous wins."""

from __future__ import annotations

import attrs
import pytest

from policies import policy_path
from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.workloads.workload import RequestSpec, Workload
from sim.profile import load_profile, save_profile

WORKLOADS = {  # (requests, prompt, output) groups, link GB/s, device blocks, update every N
    "short": ([(64, 64, 64)], 32.0, 120, 4),
    "long": ([(32, 200, 400), (4, 2000, 400)], 1.0, 600, 25),
}


def runs(tmp_path, name: str) -> dict[str, object]:
    groups, gb_per_s, blocks, every = WORKLOADS[name]
    specs = []
    for n, prompt, output in groups:
        for _ in range(n):
            specs.append(RequestSpec(index=len(specs), arrival_s=len(specs) * 0.01,
                                     prompt_tokens=prompt, output_tokens=output))
    workload = Workload(name=name, description=name, params={}, requests=tuple(specs), seed=1)
    a10 = load_profile("llama3-8b-a10")
    save_profile(attrs.evolve(a10, link=attrs.evolve(a10.link, bandwidth_gb_per_s=gb_per_s)),
                 tmp_path / "link.json")
    config = EngineConfig(backend="sim", profile=str(tmp_path / "link.json"), num_blocks=blocks,
                          cpu_swap_blocks=20000, max_num_seqs=64, max_batched_tokens=2048)
    out = {}
    for mode in ("sync", "async", "adaptive"):
        path = tmp_path / f"{mode}.policy"
        path.write_text(f'policy {mode}_swap_in extends "{policy_path("groups_random")}" {{\n'
                        f"  every {every} iterations: rerank random(seed = 7)\n"
                        f"  memory {{ swap_in {mode} }}\n}}\n")
        o = run_one(parse_policy(str(path)), workload, config, progress=False)
        assert o.error is None and o.metrics.completed == len(specs)
        out[mode] = o.metrics
    return out


@pytest.mark.parametrize(("name", "winner", "loser"), [("short", "sync", "async"),
                                                       ("long", "async", "sync")])
def test_adaptive_picks_the_mode_that_wins(tmp_path, name, winner, loser):
    m = runs(tmp_path, name)
    assert m[winner].output_tokens_per_s > 1.03 * m[loser].output_tokens_per_s, name
    chosen = m["adaptive"].swap
    picked = chosen.sync_swap_ins if winner == "sync" else chosen.async_swap_ins
    assert picked > 0.8 * (chosen.sync_swap_ins + chosen.async_swap_ins)
    assert m["adaptive"].output_tokens_per_s > 0.97 * m[winner].output_tokens_per_s
