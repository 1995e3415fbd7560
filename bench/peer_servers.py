"""The two servers of bench/peer_vllm_online.py: `vllm serve` (vLLM's CPU build, from its own
environment) and `shunter serve`, each started in a session of its own on a free loopback port,
waited for until /v1/models answers, and stopped with SIGINT (then SIGKILL to the whole session
after a grace period), with a check that no process of theirs is left; and a poller of the
driven server's waiting/running gauges and the load average."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

WAITING = {"vllm": "vllm:num_requests_waiting", "shunter": "shunter:num_requests_waiting"}
RUNNING = {"vllm": "vllm:num_requests_running", "shunter": "shunter:num_requests_running"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 5.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def gauge(text: str, name: str) -> float:
    """Sum of a Prometheus gauge's samples (over its labels) in /metrics text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def proc_stats() -> dict[int, list[str]]:
    """pid -> the fields of /proc/PID/stat after the command name (state is [0], ppid [1])."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stats[int(d)] = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
    return stats


def tree_cpu_s(pid: int) -> float:
    """User+system CPU seconds of a process and all its descendants."""
    stats, kids = proc_stats(), {}
    for p, f in stats.items():
        kids.setdefault(int(f[1]), []).append(p)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += int(stats[p][11]) + int(stats[p][12]) if p in stats else 0
        todo.extend(kids.get(p, ()))
    return total / os.sysconf("SC_CLK_TCK")


def session_schedstat(sid: int) -> dict[str, float]:
    """CPU seconds, seconds spent runnable but waiting for a core, and timeslices, summed over
    every thread of every process in session `sid` (/proc/PID/task/TID/schedstat)."""
    cpu = wait = slices = 0
    for pid in session_pids(sid):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                text = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text()
                a, b, c = (int(x) for x in text.split())
            except (OSError, ValueError):
                continue
            cpu, wait, slices = cpu + a, wait + b, slices + c
    return {"cpu_s": cpu / 1e9, "runqueue_wait_s": wait / 1e9, "timeslices": slices}


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`."""
    return [p for p, f in proc_stats().items() if int(f[3]) == sid and f[0] != "Z"]


class Server:
    """One server process (in a session of its own, so that all its children can be found)."""

    def __init__(self, side: str, args: argparse.Namespace, name: str, logdir: Path) -> None:
        self.side, self.port = side, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        common = ["--port", str(self.port), "--served-model-name", name,
                  "--max-num-seqs", str(args.max_num_seqs)]
        if side == "vllm":
            config = json.loads((args.model / "config.json").read_text())
            max_len = min(args.max_model_len, config.get("max_position_embeddings", 1 << 30))
            cmd = [str(args.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(args.model), "--dtype", "float32", "--host", "127.0.0.1",
                   "--max-model-len", str(max_len), "--max-num-batched-tokens",
                   str(args.max_batched_tokens), "--seed", "0", "--disable-uvicorn-access-log",
                   "--uvicorn-log-level", "warning", *common, *shlex.split(args.vllm_args)]
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
        else:
            cmd = [sys.executable, "-m", "shunter.cli", "serve", "--model",
                   str(args.model), "--dtype", "float32", "--max-batched-tokens",
                   str(args.max_batched_tokens), *common, *shlex.split(args.shunter_args)]
            env = dict(os.environ)
        self.cmd = cmd
        self.log_path = logdir / f"{side}_{self.port}.log"
        self.log = self.log_path.open("w")
        self.began = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=logdir)
        self.sid = self.proc.pid

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from launch until /v1/models answers; raises with the log tail if it dies."""
        while time.perf_counter() - self.began < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.side} server exited ({self.proc.returncode}) before "
                                   f"answering:\n{self.log_tail()}")
            try:
                if http_json(self.url + "/v1/models", timeout=2.0).get("data"):
                    return time.perf_counter() - self.began
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.side} server did not answer /v1/models within {timeout_s:.0f} "
                           f"s:\n{self.log_tail()}")

    def warm_up(self, name: str) -> float:
        began = time.perf_counter()
        http_json(self.url + "/v1/completions", {"model": name, "prompt": [5, 6, 7],
                                                 "max_tokens": 4, "temperature": 0.0},
                  timeout=300.0)
        return time.perf_counter() - began

    def log_tail(self, n: int = 3000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self, grace_s: float = 60.0) -> dict:
        """SIGINT, then SIGKILL to the whole session after `grace_s`; returns how it went."""
        began = time.perf_counter()
        killed = False
        if self.proc.poll() is None:
            os.killpg(self.sid, signal.SIGINT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                killed = True
        deadline = time.perf_counter() + 15.0
        while (left := session_pids(self.sid)) and time.perf_counter() < deadline:
            time.sleep(0.5)  # children (vLLM's engine core) exit after their parent
        if left:
            killed = True
            os.killpg(self.sid, signal.SIGKILL)
            time.sleep(1.0)
        if self.proc.poll() is None:
            self.proc.wait(10)
        self.log.close()
        return {"stop_s": time.perf_counter() - began, "exit_code": self.proc.returncode,
                "needed_sigkill": killed, "left_over_pids": session_pids(self.sid)}


def others_running(mine: set[int]) -> int:
    """Runnable processes outside the sessions in `mine` (other people's work on the machine)."""
    return sum(1 for f in proc_stats().values() if f[0] == "R" and int(f[3]) not in mine)


class Poller(threading.Thread):
    """Samples the driven server's waiting/running gauges, the load average and
    the runnable processes of other sessions every `every_s`."""

    def __init__(self, server: Server, idle: Server | None = None, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.mine = {server.sid, os.getsid(0), *([idle.sid] if idle else [])}
        self.server, self.samples, self.halt = server, [], threading.Event()
        self.every_s = every_s

    def sample(self) -> dict:
        row = {"t": time.perf_counter(), "load1": os.getloadavg()[0],
               "others_running": others_running(self.mine)}
        try:
            with urllib.request.urlopen(self.server.url + "/metrics", timeout=5.0) as r:
                text = r.read().decode()
            row["waiting"] = gauge(text, WAITING[self.server.side])
            row["running"] = gauge(text, RUNNING[self.server.side])
        except (OSError, ValueError, http.client.HTTPException) as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        return row

    def run(self) -> None:
        while not self.halt.is_set():
            row = self.sample()
            self.samples.append(row)
            self.halt.wait(max(0.0, self.every_s - (time.perf_counter() - row["t"])))
