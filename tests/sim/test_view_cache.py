"""A request keeps its `RequestView` until it changes (engine/request.py): every transition
drops it, and code that sets a request's fields itself calls `changed`. A kept view that no
longer matches its request would make the policy and the planner decide on stale numbers, so
here every view the scheduler reads is checked against one built afresh, through runs that
take every path that changes requests: preemption by recompute and by swap, asynchronous
swap-ins, host copies of ended turns, the device prefix cache and BROS's bidirectional blocks."""

from __future__ import annotations

import pytest

from engine.memory import device_prefixes
from engine.request import Request
from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.workloads import load_workload
from shunter.workloads.traces import FILES
from tests.conftest import slow_scale
from tests.shunter.test_workloads import write_gz

SIM = EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=300, cpu_swap_blocks=4000,
                   max_batched_tokens=1024)


@pytest.fixture
def stale_views(monkeypatch) -> list[tuple[int, object, object]]:
    """Every view read is rebuilt; a kept one that differs is recorded (id, kept, fresh). The
    scheduler reads kept views without calling `view` (`views_of`), so that read is checked too:
    without it, no kept view the scheduler read was ever checked (a planted stale view in the
    bidirectional fit went unnoticed)."""
    build, stale = Request.view, []

    def checked(self: Request):
        kept, self._view = self._view, None
        fresh = build(self)
        if kept is not None and kept != fresh:
            stale.append((self.id, kept, fresh))
        return fresh
    monkeypatch.setattr(Request, "view", checked)
    monkeypatch.setattr(device_prefixes, "views_of", lambda requests: [r.view() for r in requests])
    return stale


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces")
    write_gz(path / FILES["sharegpt"],
             "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
             "150,100,250,1.5\n300,150,450,2\n500,400,900,1.25\n800,250,1050,3.2\n")
    return path


@pytest.mark.parametrize(("policy", "workload"), [
    ("fcfs", "multiturn:conversations={n},rate=1,seed=3,max_len=3000"),  # recompute
    ("fastswitch_markov", "multiturn:conversations={n},rate=1,seed=3,max_len=3000"),  # swaps
    ("vllm_prefix_markov", "multiturn:conversations={n},rate=1,seed=3,max_len=3000"),  # cache
    ("bros", "rtbe:rate=4,duration={d},batches=3,batch_size=16"),  # bidirectional blocks
])
def test_every_kept_view_matches_its_request(stale_views, traces, policy, workload):
    spec = workload.format(n=slow_scale(24, 10), d=slow_scale(20, 8))
    w = load_workload(spec, traces_dir=traces)
    outcome = run_one(parse_policy(policy), w, SIM, progress=False)
    assert outcome.error is None, outcome.error
    m = outcome.metrics
    assert m.completed >= len(w.requests) and m.failed == 0  # rtbe adds its BE batches
    assert m.preemptions > 0, "the pool should be short of memory"
    assert not stale_views, stale_views[:3]
