"""What /proc says of a process the tests started (Linux only)."""

from __future__ import annotations

import signal


def ignores_sigint(pid: int) -> bool:
    """Whether the process ignores SIGINT (its `SigIgn` mask in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(x for x in status if x.startswith("SigIgn:"))
    return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
