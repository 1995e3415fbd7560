"""BROS §7 workloads (issue 14, item 9): Table 2's RT lengths, filtered or fitted."""

from __future__ import annotations

import gzip
import statistics
from pathlib import Path

from shunter.workloads import load_workload
from shunter.workloads.bros import LMSYS_OUTPUT, LMSYS_PROMPT, lmsys_table2, sharegpt_table2
from shunter.workloads.traces import FILES


def sharegpt(tmp_path: Path) -> Path:
    rows = "100,10\n600,500\n613,10\n100,501\n2500,900\n"
    with gzip.open(tmp_path / FILES["sharegpt"], "wt") as f:
        f.write("num_prefill_tokens,num_decode_tokens\n" + rows)
    return tmp_path


def test_sharegpt_bros_keeps_only_rows_within_table_2s_range(tmp_path):
    assert sharegpt_table2(sharegpt(tmp_path)) == [(100, 10), (600, 500)]


def test_lmsys_bros_draws_table_2s_means_and_spreads():
    table = lmsys_table2()
    for got, (mean, std) in zip(zip(*table), (LMSYS_PROMPT, LMSYS_OUTPUT)):
        assert abs(statistics.mean(got) - mean) < 0.05 * mean
        assert abs(statistics.pstdev(got) - std) < 0.1 * std
    assert lmsys_table2() == table  # seeded


def test_rtbe_draws_rt_requests_from_table_2_by_default(tmp_path):
    w = load_workload("rtbe:duration=60,rate=2", traces_dir=sharegpt(tmp_path))
    assert w.params["rt"] == "sharegpt-bros"
    assert {(r.prompt_tokens, r.output_tokens) for r in w.requests} <= {(100, 10), (600, 500)}
    lmsys = load_workload("rtbe:rt=lmsys-bros,duration=60,rate=2", traces_dir=tmp_path)
    assert lmsys.requests and all(r.request_class == "rt" for r in lmsys.requests)
