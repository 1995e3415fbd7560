"""Issue 13 item 5 (FastSwitch §4 precomputes its priority traces): two policies replaying one
workload give every request the same sequence of priorities, however differently they schedule
it. A request is named by its conversation and turn, which the workload fixes."""

from __future__ import annotations

from collections import defaultdict

import pytest

from policy_lang.state import Rerank
from shunter import EngineConfig
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import run_one
from shunter.workloads import load_workload
from shunter.workloads.traces import FILES
from tests.shunter.test_workloads import write_gz

SIM = EngineConfig(backend="sim", profile="llama3-8b-a100", num_blocks=300, cpu_swap_blocks=4000,
                   max_batched_tokens=2048)


def priority_sequences(monkeypatch, policy: str, workload) -> dict[tuple[str, int], list[float]]:
    """(conversation, turn) -> the priority the policy's rerank gave the request on arrival and
    at each update after it, in order."""
    seqs: dict[tuple[str, int], list[float]] = defaultdict(list)
    before = Rerank.before

    def recording(self, view):
        reranks = self.reranks
        before(self, view)
        for r in view.requests:
            key = (r.conversation_id, r.turn)
            if self.reranks != reranks or not seqs[key]:
                seqs[key].append(self.values[r.id])
    monkeypatch.setattr(Rerank, "before", recording)
    outcome = run_one(parse_policy(policy), workload, SIM, progress=False)
    monkeypatch.undo()
    m = outcome.metrics
    assert outcome.error is None and m.failed == 0 and m.preemptions > 0
    return seqs


@pytest.mark.parametrize("pattern", ["markov", "random"])
def test_two_policies_give_every_request_the_same_priority_sequence(monkeypatch, tmp_path, pattern):
    write_gz(tmp_path / FILES["sharegpt"],
             "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
             "300,150,450,2\n800,250,1050,3.2\n1200,300,1500,4\n")
    w = load_workload("multiturn:conversations=10,rate=1,seed=3,max_len=3000", traces_dir=tmp_path)
    base = priority_sequences(monkeypatch, f"vllm_baseline_{pattern}", w)
    fast = priority_sequences(monkeypatch, f"fastswitch_{pattern}", w)
    assert base.keys() == fast.keys() and len(base) == len(w.requests)
    compared = 0
    for key, seq in base.items():
        n = min(len(seq), len(fast[key]))
        assert seq[:n] == fast[key][:n], key
        compared += n - 1
    assert compared > 2 * len(w.requests)  # most requests saw several updates in both runs
