"""FastSwitch's ladder on the simulator (Llama-3-8B profile, small pool, multi-turn workload):
each step of the ladder must change what it claims to change, every request must end, and no
device block may be left allocated. The sizes of the effects are benchmarks
(bench/fastswitch_ladder.py), not tests; here only their direction is checked."""

from __future__ import annotations

import pytest

from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.workloads import load_workload
from shunter.workloads.traces import FILES
from tests.conftest import slow_scale
from tests.shunter.test_workloads import write_gz

SIM = EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=400, cpu_swap_blocks=6000,
                   record_iterations=True, max_batched_tokens=2048)
LAYERS = 32


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    # a ShareGPT-like length table of its own: the shared traces are not part of the repository
    traces = tmp_path_factory.mktemp("traces")
    write_gz(traces / FILES["sharegpt"],
             "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
             "150,100,250,1.5\n300,150,450,2\n500,400,900,1.25\n800,250,1050,3.2\n"
             "1200,300,1500,4\n")
    conversations = slow_scale(60, 16)
    w = load_workload(f"multiturn:conversations={conversations},rate=0.5,seed=3,max_len=4096",
                      traces_dir=traces)
    out = {}
    for name in ("vllm_baseline_markov", "groups_markov", "reuse_markov", "fastswitch_markov"):
        o = run_one(parse_policy(name), w, SIM, progress=False)
        assert o.error is None, o.error
        out[name.split("_")[0]] = o
    return w, out


def test_every_request_ends_and_swaps_happen(ladder):
    w, runs = ladder
    for o in runs.values():
        m = o.metrics
        assert m.completed == len(w.requests) and m.failed == 0
        assert m.preemptions > 0 and m.swap.blocks_out > 0 and m.swap.blocks_in > 0


def test_per_block_swap_copies_each_layer_apart_and_groups_coalesce(ladder):
    _, runs = ladder
    base = runs["vllm"].metrics.swap
    assert base.copy_ops == 2 * LAYERS * (base.blocks_out + base.blocks_in)
    groups = runs["groups"].metrics.swap
    assert groups.copy_ops < groups.blocks_out + groups.blocks_in  # under one copy per block


def test_reuse_copies_less_out_and_swaps_turn_history_in(ladder):
    _, runs = ladder
    groups, reuse = runs["groups"].metrics.swap, runs["reuse"].metrics.swap
    assert reuse.bytes_out < groups.bytes_out
    assert reuse.reused_blocks > 0 and reuse.turn_prefix_blocks > 0
    assert groups.reused_blocks == groups.turn_prefix_blocks == 0


def test_async_swap_in_stalls_the_steps_less(ladder):
    _, runs = ladder
    reuse, fastswitch = runs["reuse"].metrics.swap, runs["fastswitch"].metrics.swap
    assert fastswitch.stall_s < reuse.stall_s
    assert reuse.async_swap_ins == 0 and reuse.sync_swap_ins > 0
    assert fastswitch.async_swap_ins > 0  # adaptive: asynchronous when a stall would be long
