"""bench/peer_vllm_online.py without vLLM: its keep-up rule, its /metrics parsing, and its
server handling end to end on `shunter serve` with a tiny model (start, wait, greedy answer,
one driven `shunter bench --backend http` run, a clean stop that leaves no process behind)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import peer_servers
    import peer_vllm_online

    return peer_vllm_online, peer_servers


def test_keep_up_rule_reads_the_queue_over_the_arrival_window(online) -> None:
    mod, _ = online

    def samples(waiting: list[float]) -> list[dict]:
        return [{"t": 100.0 + i, "waiting": w, "running": 4.0} for i, w in enumerate(waiting)]

    steady = mod.queue_thirds(samples([1, 2, 1, 2, 1, 2, 1, 2, 1]), window_s=9.0)
    assert steady == (4 / 3, 4 / 3) and mod.keeps_up(*steady) is True
    growing = mod.queue_thirds(samples([0, 1, 2, 4, 6, 8, 10, 12, 14]), window_s=9.0)
    assert growing == (1.0, 12.0) and mod.keeps_up(*growing) is False
    # requests that come and go between samples: nothing ever waited
    idle = [{"t": float(i), "waiting": 0.0, "running": 0.0} for i in range(5)]
    assert mod.queue_thirds(idle, 9.0) == (0.0, 0.0)
    # /metrics never answered: unknown, and a row with an unknown side gives no ratio
    unseen = mod.queue_thirds([{"t": 1.0, "load1": 3.0}], 9.0)
    assert all(math.isnan(x) for x in unseen) and mod.keeps_up(*unseen) is None


def test_gauges_sum_over_labels_and_ignore_longer_names(online) -> None:
    _, servers = online
    text = ('# HELP vllm:num_requests_waiting x\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0\n'
            'shunter:num_requests_waiting 4\n')
    assert servers.gauge(text, "vllm:num_requests_waiting") == 5.0
    assert servers.gauge(text, "shunter:num_requests_waiting") == 4.0


def test_shunter_server_is_started_driven_and_stopped_cleanly(online, tiny_llama_dir,
                                                             tmp_path) -> None:
    mod, servers = online
    args = argparse.Namespace(
        venv=Path(sys.prefix), model=Path(tiny_llama_dir), max_num_seqs=8,
        max_batched_tokens=256, max_model_len=512, vllm_kv_gib=1, shunter_args="--threads 1",
        vllm_args="", vocab=320, run_timeout=300.0, start_timeout=120.0)
    log: dict = {}
    server = mod.start("shunter", args, "tiny", tmp_path, log)
    try:
        assert log["startups"][0]["ready_s"] > 0
        assert len(mod.greedy_tokens(server, "tiny", [5, 6, 7, 8], 6)) == 6
        spec = "sharegpt:rate=20,requests=4,seed=0,max_input=40,max_output=8"
        run = mod.drive(server, None, spec, args, tmp_path)
        polled = servers.Poller(server).sample()
        assert polled.get("waiting") == 0.0 and polled.get("running") == 0.0, polled
    finally:
        mod.stop(server, log)
    assert run["completed"] == 4 and run["failed"] == 0
    assert run["ttft_p99_ms"] > 0 and run["output_tokens_per_s"] > 0
    assert set(run) >= {"queued_first_third", "queued_last_third", "load1_mean"}
    assert run["server_sched"]["cpu_s"] > 0 and run["server_sched"]["timeslices"] > 0
    stopped = log["stops"][0]
    assert stopped["exit_code"] == 0 and stopped["left_over_pids"] == []
    assert servers.session_pids(server.sid) == []
