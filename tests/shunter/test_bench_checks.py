"""`shunter bench` checks every policy before its first run, and warns when runs came out
identical because the workload gives the policies nothing to order by."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from shunter.benchmark.plots import plot_title
from shunter.cli import main
from tests.shunter.test_workloads import traces  # noqa: F401  (fixture)

SMALL = "sharegpt:duration=10,rate=1,scale_lengths=0.2"


def test_a_broken_second_policy_fails_before_the_first_run(traces, tmp_path: Path, capsys):  # noqa: F811
    broken = tmp_path / "broken.policy"
    broken.write_text("policy broken {\n  priority = arival asc\n}\n")
    assert main(["bench", "--workload", SMALL, "--policy", "fcfs", "--policy", str(broken),
                 "--traces", str(traces), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no table: nothing ran
    assert captured.err == (f"shunter bench: {broken}:2:14: unknown field 'arival'; did you mean "
                            "'arrival'?\n    priority = arival asc\n               ^~~~~~\n")


def test_identical_runs_on_a_workload_without_priorities_classes_or_tenants_warn(traces, capsys):  # noqa: F811
    assert main(["bench", "--workload", SMALL, "--policy", "fcfs", "--policy", "priority",
                 "--traces", str(traces), "--quiet"]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        "warning: fcfs and priority produced identical results: every request of workload "
        "sharegpt has priority 0, class rt and tenant default, so the policies have nothing to "
        "order by")


def test_runs_on_a_workload_with_two_classes_do_not_warn(traces, capsys):  # noqa: F811
    assert main(["bench", "--workload", "rtbe:duration=10,rate=1,batch_size=2,scale_lengths=0.2",
                 "--policy", "fcfs", "--policy", "fcfs@max_num_seqs=64", "--traces", str(traces),
                 "--quiet"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_plot_titles_name_the_workload_backend_and_profile_or_model():
    sim = EngineConfig(backend="sim", profile="llama3-8b-a100")
    assert plot_title("rtbe", sim) == "workload rtbe, backend sim, profile llama3-8b-a100"
    torch_config = EngineConfig(backend="torch", model=Path("/models/tiny"))
    assert plot_title("sharegpt", torch_config) == "workload sharegpt, backend torch, model tiny"
