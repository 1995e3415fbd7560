"""`shunter repl`: the command layer on a fake model, and the whole program once through a real
pseudo-terminal (line editing, tab completion, history)."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

from policies import policy_path
from shunter import EngineConfig
from shunter.repl.session import open_session
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
        assert re.fullmatch(r"policy fcfs \(version 1\) for \d+ s; iteration \d+, last one "
                            r"[\d.]+ ms", status[0])
        assert re.fullmatch(r"queues: \d+ waiting, \d+ running, 0 swapped, 0 swapping in; "
                            r"\d+ of 256 KV blocks "
                            r"free; \d+ preemptions", status[1])
        assert status[2] == "overload: none (drop fired 0 times, restore 0)"
        assert status[5].split() == ["class", "done", "TTFT", "p50", "TTFT", "p99", "TPOT", "p50",
                                     "TPOT", "p99", "TTFT", "met", "TPOT", "met"]
        rt = status[7].split()
        assert rt[0] == "rt" and int(rt[1]) > 0 and rt[-2].endswith("%")

        assert s.execute("diff") == "no previous policy: nothing has been loaded or edited yet"
        assert s.execute("load bros") == (
            f"running bros (version 2) from {policy_path('bros')} (was fcfs)")
        assert s.execute("show").startswith(
            f"# running: bros version 2 ({policy_path('bros')})\n# BROS")
        wait_for(lambda: finished(s, s.workload.epoch) >= 5)
        assert "since bros was loaded:" in s.execute("status")

        diff = s.execute("edit priority rt = slack asc, waited desc")
        assert "-  priority rt = slack asc\n+  priority rt = slack asc, waited desc" in diff
        assert s.engine.policy.settings.name == "bros"
        broken = s.execute("edit priority rt = slak asc")
        assert broken.startswith(f"{policy_path('bros')}:9:17: unknown field 'slak'; did you mean "
                                 "'slack'?")
        assert "waited desc" in s.execute("show")  # the broken edit changed nothing
        assert s.execute("diff") == diff
        assert s.execute("rollback") == "running bros again (version 4; was bros)"
        assert "waited desc" not in s.execute("show")
        assert s.execute("rollback") == "running fcfs again (version 5; was bros)"
        assert s.execute("rollback") == "nothing to roll back to"

        refused = s.execute("load fastswitch_random")
        assert refused.splitlines()[0] == (
            f"{policy_path('vllm_baseline_markov')}:9:3: preempt swap is not supported by this "
            "engine (it supports: never, recompute; this engine was started with a backend that "
            "cannot swap)")
        assert s.execute("load nowhere").startswith("no shipped policy named 'nowhere'")
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
    history = tmp_path / "history"
    term = Terminal([sys.executable, "-m", "shunter.cli", "repl", "--model", str(tiny_llama_dir),
                     "--device", "cpu", "--num-blocks", "128", "--rate", "20",
                     "--history", str(history)], cwd=Path(__file__).resolve().parents[2])
    try:
        term.expect("shunter> ")
        term.send("sta\t\n")  # tab completes the command
        out = term.expect("shunter> ")
        assert "status" in out and "queues:" in out and "since fcfs was loaded:" in out
        term.send("edit priority = client_priority desc, arr\t\n")  # and a field name
        out = term.expect("shunter> ")
        assert "-  priority = arrival asc\n+  priority = client_priority desc, arrival" in \
            out.replace("\r\n", "\n")
        term.send("diff\n")
        assert "+  priority = client_priority desc" in term.expect("shunter> ")
        term.send("quit\n")
        term.expect("bye")
        assert term.proc.wait(timeout=20) == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
        os.close(term.fd)
    assert history.read_text().splitlines()[-4:] == [
        "status ", "edit priority = client_priority desc, arrival ", "diff", "quit"]


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
            assert re.fullmatch(r"policy fcfs \(version 1\) for \d+ s; iteration \d+, last one "
                                r"[\d.]+ ms", status[0])
            assert status[3] == "since fcfs was loaded:"
            assert s.execute("show").startswith(f"# running: fcfs version 1 ({policy_path('fcfs')})")
            assert s.execute("load bros") == (
                f"running bros (version 2) from {policy_path('bros')} (was fcfs)")
            diff = s.execute("edit priority rt = slack asc, waited desc")
            assert "-  priority rt = slack asc\n+  priority rt = slack asc, waited desc" in diff
            assert s.execute("diff") == diff
            broken = s.execute("edit priority rt = slak asc")
            assert broken.startswith(f"{policy_path('bros')}:9:17: unknown field 'slak'; did you "
                                     "mean 'slack'?")
            assert "waited desc" in s.execute("show")
            assert s.execute("rollback") == "running bros again (version 4; was bros)"
            assert s.execute("rollback") == "running fcfs again (version 5; was bros)"
            assert s.execute("rollback") == "nothing to roll back to"
            assert s.execute("explain").startswith(f"Policy fcfs ({policy_path('fcfs')}).")
            assert s.execute("workload pause").startswith("no workload here")
        with connect_session("http://127.0.0.1:9", timeout_s=2) as s:
            assert s.execute("status").startswith("cannot reach http://127.0.0.1:9")
    finally:
        server.stop()
