"""The torch front door's KunServe monitor (shunter/cluster/remote_groups.py
`torch_overload_monitor`) sizes a group as torch will: an uneven group (three members of
Llama-3-8B, layers 11 | 11 | 10) gets its smallest stage's capacity (gpu/stage_view.py
`group_pool_blocks`), far short of the members' pools plus a copy of the weights a member past
the first. Planned with that linear count, a pair short of memory took one more instance and
became a group of three whose real pool could not hold the queue it was formed for (the
simulator's side: tests/sim/test_kunserve_planner_pool.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from engine.cluster.dispatch import InstanceStats
from engine.cluster.drop_plan import GroupPlan
from engine.cluster.overload import Drop
from engine.cluster.plan import stage_layers
from gpu.arena import plan_layout
from gpu.config import ModelConfig
from gpu.stage_view import group_pool_blocks
from policies import policy_path
from policy_lang.api import compile_policy
from shunter.cluster.remote_groups import torch_overload_monitor

BS = 16
BASE = 2469  # an A10 instance's pool of Llama-3-8B
AT_ONCE = 'policy at_once extends "kunserve.policy" {\n  overload restore when kv_usage < 50%\n}\n'
LLAMA3_8B = ModelConfig(arch="llama", vocab_size=128_256, hidden_size=4096,
                        intermediate_size=14_336, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128)
DTYPE = torch.float16


class _Runner(SimpleNamespace):
    """What the monitor reads of the front door's unstarted TorchRunner (a `form` means it can
    lead groups)."""

    def form(self, *_):  # pragma: no cover - never called
        raise AssertionError("the monitor only plans")


def _monitor():
    policy = compile_policy(AT_ONCE, filename="<test>",
                            base_dir=Path(policy_path("fcfs")).parent)
    runner = _Runner(_model_config=LLAMA3_8B, _dtype=DTYPE, num_blocks=BASE)
    return torch_overload_monitor(policy, SimpleNamespace(block_size=BS), runner, 4)


def _pool(k: int) -> int:
    total = plan_layout(LLAMA3_8B, BS, DTYPE).weight_blocks + BASE
    return group_pool_blocks(LLAMA3_8B, BS, DTYPE, total, stage_layers(32, k))


def _stats(*, used: int, total: int, queued: int = 0) -> InstanceStats:
    return InstanceStats(waiting=1 if queued else 0, running=1, swapped=0,
                         free_blocks=total - used, total_blocks=total,
                         queued_tokens=queued * BS, head_tokens=queued * BS)


def test_the_torch_front_doors_monitor_sizes_groups_as_torch_will():
    m = _monitor()
    assert m.pool is not None, "torch_overload_monitor plans with the linear count"
    for k in (2, 3, 4):
        assert m.pool([BASE] * k) == _pool(k)
    linear = 3 * BASE + 2 * m.weight_blocks
    assert _pool(3) < linear - 5_000  # uneven: far short of the linear count
    assert m.pool([BASE] * 2) == 2 * BASE + m.weight_blocks  # a pair: as before


def test_a_short_pair_takes_both_singles_when_three_would_not_hold_its_queue():
    """Pair (0, 1) runs with 11,000 blocks held and a queue of 3,000; 2 and 3 are alone and
    nearly empty. Three would leave too little for the queue; four hold it."""
    m = _monitor()
    assert _pool(3) - 11_200 < 3_000 <= _pool(4) - 11_300
    pair = GroupPlan(group_id=0, members=(0, 1), layers=stage_layers(32, 2))
    m.formed(pair)
    stats = [_stats(used=11_000, total=_pool(2), queued=3_000), _stats(used=0, total=BASE),
             _stats(used=100, total=BASE), _stats(used=100, total=BASE)]
    alive = [True] * 4
    action = m.decide(stats, alive) or m.decide(stats, alive)  # `for 2 iterations`
    assert isinstance(action, Drop), action
    assert [g.members for g in action.new_groups] == [(0, 1, 2, 3)]
