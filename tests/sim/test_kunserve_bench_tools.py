"""The KunServe simulator benches' bookkeeping: `bench/kunserve.py --merge` re-runs part of a
report and keeps the rest as it was; `bench/kunserve_restore.py` marks the rule the shipped
policy has; `bench/kunserve_restore_table.py` compares each rule with the best of every
(window, monitor interval) cell; `bench/kunserve_pipeline_gap.py` knows which instances were in
a group when."""

from __future__ import annotations

from pathlib import Path

from bench import kunserve_restore, kunserve_restore_table
from bench.kunserve_trace import merge_report
from policies import policy_path


def test_a_merge_replaces_the_re_run_runs_in_place_and_keeps_the_rest():
    old = {"workload": "w", "mean_memory_demand": 0.56,
           "runs": {"vllm_dp": {"p": 1}, "kunserve_lookahead": {"p": 2}, "kunserve": {"p": 3}}}
    new = {"workload": "w", "chain": False, "runs": {"kunserve": {"p": 4}, "extra": {"p": 5}}}
    merged = merge_report(old, new)
    assert list(merged["runs"]) == ["vllm_dp", "kunserve_lookahead", "kunserve", "extra"]
    assert [r["p"] for r in merged["runs"].values()] == [1, 2, 4, 5]
    assert merged["mean_memory_demand"] == 0.56 and merged["chain"] is False
    assert old["runs"]["kunserve"] == {"p": 3}  # the old report is not changed


def test_the_restore_bench_marks_the_shipped_rule_once():
    text = Path(policy_path("kunserve")).read_text()
    shipped = kunserve_restore.shipped_rule()
    assert f"overload restore when {shipped}\n" in text
    marked = [k for k in kunserve_restore.VARIANTS if k.endswith(" (kunserve)")]
    assert len(marked) == 1 and kunserve_restore.VARIANTS[marked[0]] == shipped


def _report(p99: dict[tuple[str, int], float]) -> dict:
    return {"workload": "w", "runs": {
        f"{rule} @ {ms} ms": {"rule": rule, "interval_ms": ms, "ttft_p99_s": v,
                              "ttft_p50_s": 0.5, "tpot_p50_ms": 50.0, "tpot_p99_ms": 70.0,
                              "events": [[1.0, "group", [0, 1]], [9.0, "restore", [0, 1]]]}
        for (rule, ms), v in p99.items()}}


def test_the_restore_table_ranks_each_rule_against_each_cell_s_best():
    a = _report({("never", 40): 2.0, ("never", 50): 2.0, ("for 2s", 40): 1.0,
                 ("for 2s", 50): 4.0})
    b = _report({("never", 50): 3.0, ("for 2s", 50): 3.03})
    lines = kunserve_restore_table.summary({"a": a, "b": b})
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in lines
            if line.startswith("| never") or line.startswith("| for 2s")}
    # never: 2/1, 2/2, 3/3 -> worst 2.0, two cells within 2%; 2s: 1, 2, 1.01 -> worst 2.0
    assert rows["never"][:2] == ["3", f"{2 ** (1 / 3):.3f}"] and rows["never"][2] == "2.000"
    assert rows["never"][3].strip(" |") == "2"
    assert rows["for 2s"][2] == "2.000" and rows["for 2s"][3].strip(" |") == "2"
    table = kunserve_restore_table.window_table("a", a)
    assert "| for 2s | 1.00 s | 4.00 s | 0.50 s | 50.0 / 70.0 | 1/1 |" in table


def test_the_gap_bench_knows_when_an_instance_was_grouped():
    from bench.kunserve_pipeline_gap import grouped

    events = [(10.0, "group", (0, 1)), (20.0, "restore", (0, 1)), (30.0, "group", (1, 2))]
    assert [grouped(events, 0, t) for t in (5.0, 10.0, 15.0, 20.0, 35.0)] == [
        False, True, True, False, False]
    assert [grouped(events, 1, t) for t in (15.0, 25.0, 30.0)] == [True, False, True]
    assert grouped(events, 3, 40.0) is False
