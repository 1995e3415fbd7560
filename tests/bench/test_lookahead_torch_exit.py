"""bench/kunserve_lookahead_torch.py ends cleanly once it wrote its results: exit code 0 and no
"terminate called without an active exception" on stderr. Its two processes keep gloo's
threads of the group's channel (gloo cannot shut a process group down), and a normal
interpreter exit aborted in torch's teardown: the member process in most runs (signal 6), the
bench itself in about half (exit code 134), so a script or CI step reading its exit code saw a
failure. Two small runs (a 2-layer hidden-32 model, one round, no warm-up)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_lookahead_bench_exits_cleanly(tmp_path):
    for run in range(2):
        out = tmp_path / f"look{run}.json"
        done = subprocess.run(
            [sys.executable, "bench/kunserve_lookahead_torch.py", "--rounds", "1", "--warmup",
             "0", "--window", "3", "--decodes", "1", "--layers", "2", "--hidden", "32",
             "--blocks", "128", "--out", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (run, done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr, (run, done.stderr[-2000:])
        assert "lookahead bubble" in done.stdout, done.stdout
        assert set(json.loads(out.read_text())) >= {"tokens", "lookahead", "fit"}
