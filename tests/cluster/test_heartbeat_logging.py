"""An instance process logs a failure without stalling the event loop that answers the front
door's pings (shunter/cluster/instance.py `configure_logging`): its tracebacks are printed
plainly, never rendered by rich with every frame's locals, which took seconds of that loop for
a head recovering from a lost member at load 8-10 (it was found silent, README "Cluster").
Checked in a fresh interpreter, as an instance process starts: a local whose `repr` is counted
sits in the logged traceback's frames."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import structlog
    from {module} import {function}

    {function}()
    seen = []

    class Costly:
        def __repr__(self):
            seen.append(1)
            return "Costly()"

    def step(costly):
        raise RuntimeError("the step failed")

    try:
        step(Costly())
    except RuntimeError:
        structlog.get_logger(actor="executor").exception("step failed", step_id=3)
    print("reprs", len(seen))
""")


@pytest.mark.parametrize("entry", [("shunter.cluster.instance", "configure_logging"),
                                   ("engine.logs", "configure_default")])  # (the front door's)
def test_an_instance_process_logs_a_traceback_without_rendering_its_locals(tmp_path, entry):
    script = tmp_path / "instance_log.py"  # a file: the traceback shows its source lines
    script.write_text(SCRIPT.format(module=entry[0], function=entry[1]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "reprs 0", (done.stdout, done.stderr[-2000:])
    err = done.stderr
    # a pipe gets no colour codes (as structlog's default): `key=value` stays greppable (the
    # front door test reads "cancelled=[]" from an instance's captured stderr)
    assert "\x1b[" not in err, err[-2000:]
    assert "step failed" in err and "step_id=3" in err, err[-2000:]
    assert 'raise RuntimeError("the step failed")' in err, err[-2000:]  # the frames are there
    assert "RuntimeError: the step failed" in err, err[-2000:]
    assert "╭" not in err and "locals" not in err.lower(), err[-2000:]  # no rich panel


def test_a_process_that_configured_structlog_keeps_its_configuration():
    script = textwrap.dedent("""
        import structlog
        from shunter.cluster.instance import configure_logging

        structlog.configure(processors=[structlog.processors.JSONRenderer()])
        configure_logging()
        print(type(structlog.get_config()["processors"][-1]).__name__)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "JSONRenderer", (done.stdout, done.stderr[-2000:])
