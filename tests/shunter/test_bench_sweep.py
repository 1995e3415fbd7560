"""`shunter bench --sweep KEY=V1,V2,...` (issue 13): every policy at every value of a workload
key, one table, one JSON and one plot; a run whose queue grows is marked as not keeping up."""

from __future__ import annotations

import json

import pytest

from engine.errors import ConfigError
from shunter.benchmark.sweep import keeps_up, parse_sweep, with_key
from shunter.cli import main
from tests.shunter.test_workloads import traces  # noqa: F401  (fixture)


def test_the_sweep_key_replaces_the_specs_own():
    assert parse_sweep("rate=0.1, 0.2") == ("rate", ["0.1", "0.2"])
    assert with_key("sharegpt:requests=10,rate=5", "rate", "2") == "sharegpt:requests=10,rate=2"
    assert with_key("sharegpt", "rate", "2") == "sharegpt:rate=2"
    for bad in ("rate", "rate=", "=1,2"):
        with pytest.raises(ConfigError, match="expected KEY=V1,V2"):
            parse_sweep(bad)
    assert keeps_up(4.0, 7.0) and not keeps_up(4.0, 9.0)


def test_shunter_bench_sweeps_a_key_and_marks_where_the_queue_grows(traces, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "sweep.json"
    rc = main(["bench", "--workload", "sharegpt:requests=60,seed=2", "--sweep", "rate=1,60",
               "--policy", "fcfs", "--policy", "fcfs@max_num_seqs=2", "--num-blocks", "200",
               "--traces", str(traces), "--json", str(out), "--quiet"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "keeps up" in table and "fcfs@max_num_seqs=2" in table
    data = json.loads(out.read_text())
    assert data["sweep"] == {"key": "rate", "values": ["1", "60"]}
    rows = {(r["rate"], r["policy"]): r for r in data["rows"]}
    assert len(rows) == 4
    # a batch of 2 falls behind 60 requests/s; everything keeps up with 1 request/s
    assert not rows[("60", "fcfs@max_num_seqs=2")]["keeps_up"]
    assert rows[("1", "fcfs")]["keeps_up"] and rows[("1", "fcfs@max_num_seqs=2")]["keeps_up"]
    assert rows[("60", "fcfs@max_num_seqs=2")]["vs_first"]["throughput_ratio"] < 0.5


def test_the_sweep_plot(traces, tmp_path):  # noqa: F811
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib: pip install -e '.[plot]'")
    rc = main(["bench", "--workload", "sharegpt:requests=10", "--sweep", "rate=1,5",
               "--traces", str(traces), "--plot", str(tmp_path / "p"), "--quiet"])
    assert rc == 0
    assert (tmp_path / "p" / "sweep_rate.png").read_bytes()[:4] == b"\x89PNG"
