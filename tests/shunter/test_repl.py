"""`shunter repl`: the command layer on a fake model, and the whole program once through a real
pseudo-terminal (line editing, tab completion, history)."""

from __future__ import annotations

import io
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

from prompt_toolkit.history import FileHistory

from policies import policy_path
from shunter import EngineConfig
from shunter.repl.session import open_session
from shunter.repl.terminal import run_terminal
from tests.fakes import fake_backend

CONFIG = EngineConfig(block_size=4, max_num_seqs=8, max_batched_tokens=64)


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def finished(session, policy_epoch: int | None = None) -> int:
    w = session.workload
    return sum(1 for f in list(w.finished) if policy_epoch is None or f.epoch == policy_epoch)


def test_the_command_layer_shows_loads_edits_diffs_and_rolls_back():
    with open_session(CONFIG, backend=fake_backend(256, 4, step_delay=0.001), rate=200) as s:
        assert s.execute("help").startswith("commands:\n  status")
        assert s.execute("") == ""
        assert s.execute("stauts") == "unknown command 'stauts'; did you mean 'status'? (type help)"
        wait_for(lambda: finished(s) >= 10)
        status = s.execute("status").splitlines()
        assert re.fullmatch(r"policy fcfs v1 for \d+ s; iteration \d+, last one [\d.]+ ms",
                            status[0])
        assert re.fullmatch(r"queues: \d+ waiting, \d+ running, 0 swapped, 0 swapping in; "
                            r"\d+ of 256 KV blocks "
                            r"free; \d+ preemptions", status[1])
        assert status[2] == "overload: none (drop fired 0 times, restore 0)"
        assert status[4] == "since fcfs v1 was loaded (latencies in ms):"
        assert status[5] == "  class  done  TTFT p50  TTFT p99  TPOT p50  TPOT p99  TTFT met  TPOT met"
        rt = status[6].split()
        assert rt[0] == "rt" and int(rt[1]) > 0 and rt[-2].endswith("%")

        assert s.execute("diff") == "no previous policy: nothing has been loaded or edited yet"
        assert s.execute("load bros_no_bicache") == (
            f"applied: policy bros_no_bicache v2 from {policy_path('bros_no_bicache')} "
            f"(was fcfs v1)")
        assert s.execute("show").startswith(
            f"# running: bros_no_bicache v2 ({policy_path('bros_no_bicache')})\n# BROS")
        wait_for(lambda: finished(s, s.workload.epoch) >= 5)
        assert "since bros_no_bicache v2 was loaded (latencies in ms):" in s.execute("status")

        edited = s.execute("edit priority rt = slack asc, waited desc").split("\n", 1)
        assert edited[0] == "applied: policy bros_no_bicache v3"
        assert "-  priority rt = slack asc\n+  priority rt = slack asc, waited desc" in edited[1]
        assert s.engine.policy.settings.name == "bros_no_bicache" and s.engine.policy_version == 3
        assert s.execute("edit priority rt = slak asc") == (
            "not applied: the running policy is still bros_no_bicache v3\n"
            "<edit>:1:15: unknown field 'slak'; did you mean 'slack'?\n"
            "  priority rt = slak asc\n"
            "                ^~~~")
        assert "waited desc" in s.execute("show")  # the broken edit changed nothing
        assert s.execute("diff") == "v2 -> v3 (bros_no_bicache)\n" + edited[1]
        assert s.execute("rollback") == (
            "rolled back: v3 -> v4, policy bros_no_bicache as it ran in v2 (was bros_no_bicache)")
        assert "waited desc" not in s.execute("show")
        assert s.execute("diff").startswith(
            "v1 -> v4 (bros_no_bicache)\n--- fcfs (running)\n+++ bros_no_bicache (new)")
        assert s.execute("rollback") == (
            "rolled back: v4 -> v5, policy fcfs as it ran in v1 (was bros_no_bicache)")
        assert s.execute("rollback") == "nothing to roll back to"

        refused = s.execute("load fastswitch_random")
        assert refused.splitlines()[0] == (
            f"{policy_path('vllm_baseline_markov')}:9:3: preempt swap is not supported by this "
            "engine (it supports: never, recompute; this engine was started with a backend that "
            "cannot swap)")
        assert s.execute("load fcsf").startswith(
            "fcsf: no such policy file or shipped policy; did you mean fcfs? shipped: bros, ")
        assert s.engine.policy.settings.name == "fcfs"
        assert s.execute("explain").startswith(f"Policy fcfs ({policy_path('fcfs')}).")

        assert s.execute("workload pause") == "workload paused"
        assert "paused" in s.execute("status").splitlines()[3]
        assert s.execute("workload rate 2.5") == "workload rate 2.5 requests/s"
        assert s.execute("workload resume") == "workload resumed at 2.5 requests/s"
        assert s.execute("workload rate fast") == "rate must be a number of requests per second, got 'fast'"
        assert s.execute("workload") == "usage: workload pause | resume | rate N"
        assert s.workload.failed == 0
        assert s.execute("quit") == "bye" and s.done


class Terminal:
    """A child process on a pseudo-terminal, read until an expected text appears."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        master, slave = os.openpty()
        env = dict(os.environ, TERM="dumb", COLUMNS="200", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd,
                                     env=env, close_fds=True)
        os.close(slave)
        self.fd = master
        self.seen = ""

    def expect(self, text: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"never saw {text!r}; got:\n{self.seen}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096).decode(errors="replace")
                except OSError:
                    chunk = ""
                if not chunk:
                    assert text in self.seen, f"the process ended; got:\n{self.seen}"
                self.seen += chunk
        before, _, self.seen = self.seen.partition(text)
        return before

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())


def test_the_repl_works_in_a_real_terminal(tiny_llama_dir, tmp_path):
    # prompt_toolkit on a dumb terminal: it echoes the last character of each change, so a
    # completion shows as its trailing space and the answers show that it happened
    history = tmp_path / "history"
    term = Terminal([sys.executable, "-m", "shunter.cli", "repl", "--model", str(tiny_llama_dir),
                     "--device", "cpu", "--num-blocks", "128", "--rate", "20",
                     "--history", str(history)], cwd=Path(__file__).resolve().parents[2])
    try:
        term.expect("shunter> ")
        term.send("sta\t\n")  # tab completes the command
        out = term.expect("shunter> ")
        assert "queues:" in out and "since fcfs v1 was loaded (latencies in ms):" in out
        term.send("edit priority = client_priority desc, arr\t\n")  # and a field name
        out = term.expect("shunter> ").replace("\r\n", "\n")
        assert "applied: policy fcfs v2\n" in out
        assert "-  priority = arrival asc\n+  priority = client_priority desc, arrival" in out
        term.send("edit\n")  # a rule of several lines, ended by a blank line
        term.expect("Ctrl-C drops it")
        term.send("priority =\n  arrival desc\n\n")
        out = term.expect("shunter> ").replace("\r\n", "\n")
        assert "applied: policy fcfs v3\n" in out
        assert "+  priority =\n+  arrival desc\n" in out
        term.send("diff\n")
        assert "v2 -> v3 (fcfs)" in term.expect("shunter> ")
        term.send("quit\n")
        term.expect("bye")
        assert term.proc.wait(timeout=20) == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
        os.close(term.fd)
    assert list(FileHistory(str(history)).load_history_strings())[::-1] == [
        "status ", "edit priority = client_priority desc, arrival ", "edit",
        "edit priority = arrival desc", "diff", "quit"]


def test_piped_commands_run_without_a_terminal(tmp_path):
    commands = io.StringIO("help\nedit\npriority =\n  arrival desc\n\nedit\npriority = arrivl\n"
                           "\nnonsense\nquit\nstatus\n")
    out = io.StringIO()
    with open_session(CONFIG, backend=fake_backend(64, 4), rate=0) as s:
        run_terminal(s, history=None, stdin=commands, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "shunter repl: type help for the commands, quit to leave"
    assert lines[1] == "commands:"
    rest = lines[lines.index("  quit                  stop the engine and leave") + 1:]
    assert rest[0] == "applied: policy fcfs v2"
    assert "+  priority =" in rest and "+  arrival desc" in rest
    assert rest[rest.index("not applied: the running policy is still fcfs v2"):] == [
        "not applied: the running policy is still fcfs v2",
        "<edit>:1:12: unknown field 'arrivl'; did you mean 'arrival'?",
        "  priority = arrivl",
        "             ^~~~~~",
        "unknown command 'nonsense' (type help)",
        "bye"]  # and nothing after quit


def test_the_commands_drive_a_running_server_with_connect():
    from shunter.repl.session import connect_session
    from shunter.server import ServerSettings
    from tests.shunter.server.conftest import ServerThread

    config = EngineConfig(backend="sim", block_size=16)
    server = ServerThread(config, ServerSettings(api_key="sesame"), "asyncio").start()
    try:
        with connect_session(server.url, api_key="wrong") as s:
            assert s.execute("show").startswith("GET /admin/policy: 401 a valid API key")
        with connect_session(server.url, api_key="sesame") as s:
            status = s.execute("status").splitlines()
            assert re.fullmatch(r"policy fcfs v1 for \d+ s; iteration \d+, last one [\d.]+ ms",
                                status[0])
            assert status[3] == "since fcfs v1 was loaded (latencies in ms):"
            assert s.execute("show").startswith(f"# running: fcfs v1 ({policy_path('fcfs')})")
            assert s.execute("load bros_no_bicache") == (
                f"applied: policy bros_no_bicache v2 from {policy_path('bros_no_bicache')} "
                f"(was fcfs v1)")
            edited = s.execute("edit priority rt = slack asc, waited desc").split("\n", 1)
            assert edited[0] == "applied: policy bros_no_bicache v3"
            assert "-  priority rt = slack asc\n+  priority rt = slack asc, waited desc" in edited[1]
            assert s.execute("diff") == "v2 -> v3 (bros_no_bicache)\n" + edited[1]
            # the server knows only the start of each error: the caret is one character wide
            assert s.execute("edit priority rt = slak asc") == (
                "not applied: the running policy is still bros_no_bicache v3\n"
                "<edit>:1:15: unknown field 'slak'; did you mean 'slack'?\n"
                "  priority rt = slak asc\n"
                "                ^")
            assert "waited desc" in s.execute("show")
            assert s.execute("rollback") == (
                "rolled back: v3 -> v4, policy bros_no_bicache as it ran in v2 "
                "(was bros_no_bicache)")
            assert s.execute("rollback") == (
                "rolled back: v4 -> v5, policy fcfs as it ran in v1 (was bros_no_bicache)")
            assert s.execute("rollback") == "nothing to roll back to"
            assert s.execute("explain").startswith(f"Policy fcfs ({policy_path('fcfs')}).")
            assert s.execute("workload pause").startswith("no workload here")
        with connect_session("http://127.0.0.1:9", timeout_s=2) as s:
            assert s.execute("status").startswith("cannot reach http://127.0.0.1:9")
    finally:
        server.stop()


def test_the_workload_keeps_a_be_backlog_as_deep_as_the_batch_so_requests_queue():
    with open_session(CONFIG, backend=fake_backend(256, 4, step_delay=0.002), rate=0) as s:
        wait_for(lambda: finished(s) >= 10)  # a closed loop: finished BE requests are replaced
        wait_for(lambda: s.workload.in_flight == {"rt": 0, "be": 8})
        assert max(f.label for f in s.workload.finished) == "be"
        s.workload.rate = 100  # any RT arrival now waits behind a full batch, as the policy says
        wait_for(lambda: s.engine.policy_version == 1 and "waiting" in s.execute("status")
                 and int(s.execute("status").splitlines()[1].split()[1]) > 0)
        s.execute("workload pause")
        assert s.execute("status").splitlines()[3].startswith("workload: paused; in flight rt ")
