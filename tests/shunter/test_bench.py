"""`shunter bench` and `shunter profile` end to end on the sim backend, on small traces."""

from __future__ import annotations

import io
import json

import attrs
import pytest

from engine.metrics import Percentiles

from policies import policy_path
from shunter import EngineConfig, PolicyError
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.progress import Progress
from shunter.benchmark.report import table
from shunter.benchmark.run import RunOutcome, report_json, run_one
from shunter.cli import main
from shunter.workloads import load_workload
from tests.shunter.test_workloads import traces  # noqa: F401  (fixture)

SIM = EngineConfig(backend="sim", record_iterations=True)
NO_SWAP_SPACE = "this engine has no swap space: --cpu-swap-blocks is 0"


def test_the_sim_replays_deterministically(traces):  # noqa: F811
    w = load_workload("sharegpt:requests=30,rate=5", traces_dir=traces)
    a = run_one(parse_policy("fcfs"), w, SIM, progress=False)
    b = run_one(parse_policy("fcfs"), w, SIM, progress=False)
    assert a.error is None and a.metrics.completed == 30 and a.metrics.failed == 0
    assert a.metrics.ttft_ms == b.metrics.ttft_ms and a.metrics.tbt_ms == b.metrics.tbt_ms
    assert a.metrics.iterations == b.metrics.iterations > 0


def test_later_turns_wait_for_the_answer_and_their_think_time(traces):  # noqa: F811
    w = load_workload("multiturn:conversations=4,turns=3,think=2", traces_dir=traces)
    o = run_one(parse_policy("fcfs"), w, SIM, progress=False)
    assert o.metrics.completed == len(w.requests)
    by_conv: dict[str, list] = {}
    for t in sorted(o.drive.timelines, key=lambda t: t.arrival):
        by_conv.setdefault(t.conversation_id, []).append(t)
    think = {s.conversation_id: [] for s in w.requests}
    for s in w.requests:
        if s.after_parent_s is not None:
            think[s.conversation_id].append(s.after_parent_s)
    checked = 0
    for conv, turns in by_conv.items():
        for prev, nxt, gap in zip(turns, turns[1:], think[conv]):
            assert nxt.arrival - prev.finished_at == pytest.approx(gap)
            assert nxt.prompt_tokens > prev.prompt_tokens + prev.output_tokens
            checked += 1
    assert checked > 0


def test_be_batches_run_in_a_closed_loop(traces):  # noqa: F811
    w = load_workload("be-batch:batches=3,batch_size=4,scale_lengths=0.1", traces_dir=traces)
    o = run_one(parse_policy("fcfs"), w, SIM, progress=False)
    assert o.metrics.completed == 12 and o.metrics.be_requests_per_s > 0
    arrivals = sorted({round(t.arrival, 9) for t in o.drive.timelines})
    finished = sorted(t.finished_at for t in o.drive.timelines)
    assert len(arrivals) == 3
    assert arrivals[1] == pytest.approx(finished[3]) and arrivals[2] == pytest.approx(finished[7])


def test_a_policy_the_engine_refuses_is_a_failed_run_not_a_crash(traces):  # noqa: F811
    # FastSwitch's baseline preempts by swap, which an engine without host swap space lacks
    w = load_workload("sharegpt:requests=3", traces_dir=traces)
    o = run_one(parse_policy("vllm_baseline_markov@cpu_swap_blocks=0"), w, SIM, progress=False)
    where, no_swap = policy_path("vllm_baseline_markov"), NO_SWAP_SPACE
    assert o.error.splitlines()[::3] == [
        (f"PolicyCheckError: {where}:9:3: preempt swap is not supported by this engine (it "
         f"supports: never, recompute; {no_swap})"),
        f"{where}:10:12: swap_granularity per-block is not supported by this engine ({no_swap})",
        f"{where}:10:40: swap_in sync is not supported by this engine ({no_swap})"]
    assert o.metrics is None
    assert report_json(w, SIM, [o])["runs"][0]["error"] == o.error


def test_policy_arguments(tmp_path):
    assert parse_policy("fcfs@max_num_seqs=8").overrides == {"max_num_seqs": 8}
    with pytest.raises(PolicyError, match=r"'speed=2' is not key=value with a key among max_num_seqs"):
        parse_policy("fcfs@speed=2")
    with pytest.raises(PolicyError, match=r"--policy .*missing.policy: no such policy file or shipped policy; shipped: bros, "):
        parse_policy(str(tmp_path / "missing.policy"))


def test_shunter_bench_writes_the_json_of_the_issue(traces, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "r.json"
    rc = main(["bench", "--workload", "rtbe:duration=20,rate=1,batch_size=4,scale_lengths=0.2",
               "--policy", "fcfs", "--policy", "fcfs@max_num_seqs=4", "--traces", str(traces),
               "--json", str(out), "--quiet"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "fcfs@max_num_seqs=4" in table and "TTFT p50" in table
    data = json.loads(out.read_text())
    assert data["backend"] == "sim" and data["workload"]["name"] == "rtbe"
    assert [r["policy"] for r in data["runs"]] == ["fcfs", "fcfs@max_num_seqs=4"]
    m = data["runs"][1]["metrics"]
    for key in ("ttft_ms", "tbt_ms", "tpot_ms", "e2e_ms", "normalized_latency_ms"):
        assert set(m[key]) == {"p50", "p90", "p95", "p99", "p999", "mean"}
    assert set(m["slo_attainment"]) == {"rt", "be"} and set(m["slo_attainment"]["rt"]) >= {"ttft", "tpot"}
    assert m["be_requests_per_s"] > 0 and m["goodput_rps"] > 0 and m["output_tokens_per_s"] > 0
    assert set(m["swap"]) >= {"copy_ops", "bytes_out", "bytes_in", "stall_ms"}
    assert set(m["scheduler_ms_per_iteration"]) >= {"p50", "p99"}
    assert m["requests"]["failed"] == 0 and m["requests"]["completed"] > 0
    assert data["runs"][1]["engine"]["max_num_seqs"] == 4
    assert len(data["runs"][0]["timeseries"]["t_s"]) > 0


def test_shunter_bench_plots(traces, tmp_path):  # noqa: F811
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib: pip install -e '.[plot]'")
    rc = main(["bench", "--workload", "sharegpt:requests=10,rate=5", "--traces", str(traces),
               "--plot", str(tmp_path / "plots"), "--quiet"])
    assert rc == 0
    for name in ("latency_cdf.png", "timeline.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_without_matplotlib_say_how_to_get_it(traces, tmp_path, monkeypatch, capsys):  # noqa: F811
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    rc = main(["bench", "--workload", "sharegpt:requests=2", "--traces", str(traces),
               "--plot", str(tmp_path), "--quiet"])
    assert rc == 2
    # refused before the run: not even the workload line that opens a run is printed
    assert capsys.readouterr().err == (
        "shunter bench: --plot needs matplotlib, which is not installed: pip install "
        "'shunter[plot]' (or pip install matplotlib)\n")


def test_shunter_profile_list_prints_one_name_a_line(capsys):
    assert main(["profile", "list"]) == 0
    names = capsys.readouterr().out.splitlines()
    assert "llama3-8b-a100" in names and names == sorted(names)


def test_the_bench_table_is_plain_text_one_row_per_policy(traces):  # noqa: F811
    w = load_workload("sharegpt:requests=30,rate=5", traces_dir=traces)
    ran = run_one(parse_policy("fcfs"), w, SIM, progress=False)
    # the two wall-clock columns, pinned so that the text is exact
    ran = attrs.evolve(ran, wall_s=1.25, metrics=attrs.evolve(
        ran.metrics, scheduler_ms_per_iteration=Percentiles.of([0.0421])))
    failed = RunOutcome(label="bros@max_num_seqs=1", config=None, wall_s=0.0,
                        error="PolicyCheckError: it cannot\nsecond line")
    assert table([ran, failed]).splitlines() == [
        "policy               done  fail  TTFT p50  TTFT p99  TBT p99  TPOT p50  e2e p50  SLO ok  "
        "goodput/s  out tok/s  BE req/s  preempt  swap MB  sched ms  wall s",
        "fcfs                   30     0      33.7      43.4     33.9      10.7    322.5  100.0%  "
        "     4.70      112.7      0.00        0      0.0     0.042     1.2",
        "bros@max_num_seqs=1     -     -         -         -        -         -        -       -  "
        "        -          -         -        -        -         -       -",
        "bros@max_num_seqs=1: failed: PolicyCheckError: it cannot"]


def test_the_progress_bar_prints_its_last_state_when_not_on_a_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = io.StringIO()
    bar = Progress("fcfs", 40, stream=out, clock=lambda: 12.5)
    for done in range(1, 38):
        bar.update(done, 0)
    bar.update(37, 3)
    bar.close()
    # no redraws into a pipe or a log: one line, at the end
    assert out.getvalue() == (
        "fcfs: " + "━" * 26 + " 40/40 failed 3 engine clock 12.5 s wall 0:00:00\n")
