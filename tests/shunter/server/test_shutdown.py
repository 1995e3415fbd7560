"""`shunter serve` as a user runs it: SIGTERM drains, then cuts what is still running."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not come up")


def test_sigterm_drains_then_cancels_the_rest_and_exits_cleanly():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # the sim backend in real time: a 4,000-token answer takes far longer than the drain
    proc = subprocess.Popen(
        [sys.executable, "-m", "shunter.cli", "serve", "--backend", "sim", "--port", str(port),
         "--drain-timeout", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_healthy(url, proc)
        events: list[str] = []

        def stream() -> None:
            body = {"prompt": [5, 6, 7], "max_tokens": 4000, "stream": True,
                    "return_token_ids": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30.0) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 30
        while len(events) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(events) >= 2, "the stream never started"
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 1})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_dead"
        reader.join(timeout=30)
        assert not reader.is_alive()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["error"]["code"] == "engine_dead"
    tokens = sum(len(json.loads(e[6:]).get("choices", [{}])[0].get("token_ids") or [])
                 for e in events[:-2])
    assert 0 < tokens < 4000
    assert "SIGTERM: draining 1 requests (up to 1 s)" in out + err
    assert "cancelled 1 requests still running at the drain deadline" in out + err
