"""bench/kunserve_rerun.py, the round re-runner: its commands make each recorded file's workload
again (trace, window, rate and lengths), re-run only the KunServe rows, and `collect` reads back
what each command re-ran and what round 12 (or round 9) recorded for it. No simulation runs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import kunserve_rerun
from bench.kunserve_trace import add_trace_args

RESULTS = Path(kunserve_rerun.__file__).resolve().parent / "results"


def _spec(argv: list[str]) -> str:
    """The workload spec bench/kunserve_trace.py builds from `argv` (as `trace_workload`)."""
    import argparse

    ap = argparse.ArgumentParser()
    add_trace_args(ap)
    args, _ = ap.parse_known_args(argv)
    spec = f"{args.trace}:start={args.start},duration={args.duration},rate={args.rate}"
    return spec + (f",{args.lengths}" if args.lengths else "")


@pytest.mark.parametrize("spec", [
    "azure-conv:start=1560.0,duration=45.0,rate=0.1x,scale_lengths=5,max_input=12000,"
    "max_output=1000",
    "mooncake-conv:start=3000.0,duration=45.0,rate=0.1x,max_input=12000,max_output=1000",
    "azure-code:start=780.0,duration=180.0,rate=0.5x",
])
def test_a_workload_spec_becomes_the_arguments_that_make_it_again(spec):
    assert _spec(kunserve_rerun.workload_args(spec)) == spec


def test_a_workload_spec_without_its_window_is_refused_by_name():
    with pytest.raises(ValueError, match="has no duration"):
        kunserve_rerun.workload_args("azure-conv:start=1.0,rate=1x")


def test_the_plan_re_runs_every_recorded_file_s_workload():
    plan = kunserve_rerun.plan()
    assert [len([c for c in plan if c["set"] == s]) for s in ("files", "modes", "rules")] == [
        20, 16, 17]
    assert len({c["name"] for c in plan}) == len(plan)
    for c in plan:
        assert "--out" not in c["argv"]  # `run` gives each its scratch output
        if c["set"] == "files":
            assert c["merge"] and "--merge" in c["argv"]
            assert (RESULTS / f"{c['name']}.json").exists()
        else:
            assert not c["merge"] and c["argv"][0] == "bench/kunserve_restore.py"
    # each restore command makes its recorded file's workload (rounds 9 and 12)
    for c in plan:
        if c["set"] == "rules":
            f = next(f for f in kunserve_rerun.RULE_FILES
                     if kunserve_rerun._rule_name(f) == c["name"])
            recorded = json.loads((RESULTS / f"kunserve_restore_{f}.json").read_text())
            assert _spec(c["argv"][1:]) == recorded["workload"]
            assert c["argv"][-2:] == ["--only", kunserve_rerun.RULES]
        if c["set"] == "modes":
            w = c["name"].removeprefix("modes_").removesuffix("_halflinks")
            recorded = json.loads((RESULTS / f"kunserve_restore_round12_{w}.json").read_text())
            assert _spec(c["argv"][1:]) == recorded["workload"]
            assert ("--link-scale" in c["argv"]) == c["name"].endswith("_halflinks")


def test_the_committed_command_list_is_the_plan():
    assert json.loads(kunserve_rerun.COMMANDS.read_text()) == kunserve_rerun.plan()


def test_collect_reads_back_the_re_run_rows_and_the_recorded_ones(tmp_path):
    plan = {c["name"]: c for c in kunserve_rerun.plan()}
    row = {"ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "tpot_p50_ms": 50.0, "tpot_p99_ms": 70.0,
           "events": [[10.0, "group", [0, 1]]]}
    report = {"workload": "w", "runs": {"vllm_dp": row, "kunserve_drop": row,
                                        "kunserve_lookahead": row, "memory_oracle": row}}
    assert list(kunserve_rerun.kunserve_rows(plan["kunserve_sim_longctx_02x_eq1paper"],
                                             report)) == ["kunserve_lookahead"]
    assert set(kunserve_rerun.kunserve_rows(plan["kunserve_dispatch_code_1x"], {"runs": {
        "vllm_dp / freeness": row, "kunserve / freeness": row}})) == {"kunserve / freeness"}
    rules = kunserve_rerun.recorded_rows(plan["rules_conv_09x"])
    assert set(kunserve_rerun._norm(rules)) == {"never (kunserve_lookahead)", "for 4s",
                                                "40% for 4s"}
    assert kunserve_rerun.recorded_rows(plan["modes_conv_095x_halflinks"]) is None
    after = tmp_path / "after"
    after.mkdir()
    (after / "kunserve_sim_conv.json").write_text(json.dumps(
        {"workload": "w", "runs": {"vllm_dp": row, "kunserve": row | {"ttft_p99_s": 1.5}}}))
    (after / "runs.jsonl").write_text(json.dumps({"name": "kunserve_sim_conv", "rc": 0}) + "\n")
    kunserve_rerun.collect(SimpleNamespace(scratch=str(tmp_path), labels="after",
                                           out=str(tmp_path / "r")))
    out = json.loads((tmp_path / "r.json").read_text())
    assert list(out["files"]) == ["kunserve_sim_conv"]
    assert out["files"]["kunserve_sim_conv"]["after"]["kunserve"]["ttft_p99_s"] == 1.5
    assert out["files"]["kunserve_sim_conv"]["recorded"]["kunserve"]["ttft_p99_s"] == \
        pytest.approx(1.856, abs=1e-3)
    md = (tmp_path / "r.md").read_text()
    assert "| kunserve | after, after | 1.000 | 1.500 | 50.0 | 70.0 |" in md
    assert "- kunserve_sim_conv / kunserve: recorded P99 TTFT 1.856 s; after P99 TTFT 1.500 s" \
        in md
    assert "1.33x" in md  # P99 against the best KV-centric baseline of the file (vllm_dp 2.0 s)


def test_a_whole_re_run_drops_the_row_selection_and_the_merge():
    plan = {c["name"]: c for c in kunserve_rerun.plan()}
    ladder = kunserve_rerun.whole(plan["kunserve_sim_longctx"]["argv"])
    assert "--merge" not in ladder and "--only" not in ladder
    assert ladder[-2:] == ["--instances", "4"]
    assert _spec(ladder[1:]) == _spec(plan["kunserve_sim_longctx"]["argv"][1:])
    dispatch = kunserve_rerun.whole(plan["kunserve_dispatch_conv_1x"]["argv"])
    assert dispatch[-2:] == ["--policies", "vllm_dp,kunserve"] and "--merge" not in dispatch


def test_collect_shows_every_row_of_a_whole_re_run(tmp_path):
    row = {"ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "tpot_p50_ms": 50.0, "tpot_p99_ms": 70.0}
    after = tmp_path / "after"
    after.mkdir()
    (after / "kunserve_sim_conv.json").write_text(json.dumps(
        {"workload": "w", "runs": {"vllm_dp": row, "kunserve": row | {"ttft_p99_s": 1.0}}}))
    (after / "runs.jsonl").write_text(json.dumps(
        {"name": "kunserve_sim_conv", "rc": 0, "whole": True}) + "\n")
    kunserve_rerun.collect(SimpleNamespace(scratch=str(tmp_path), labels="after",
                                           out=str(tmp_path / "r")))
    got = json.loads((tmp_path / "r.json").read_text())["files"]["kunserve_sim_conv"]
    assert set(got["after"]) == {"vllm_dp", "kunserve"}
    assert {"vllm_dp", "infercept_swap", "kunserve"} <= set(got["recorded"])
    assert "| kunserve | after, after | 1.000 | 1.000 | 50.0 | 70.0 |  |  |  | 2.00x |" in \
        (tmp_path / "r.md").read_text()
