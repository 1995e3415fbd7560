"""bench/kunserve_plot.py draws a line where a group formed (red) and where one restored
(green), and none for other events: the torch runs' `swept` and `rescheduled` events, and
faults, were drawn as restores (review s32)."""

from __future__ import annotations

from bench.kunserve_plot import event_lines


def test_only_groups_and_restores_get_a_line():
    events = [{"t": 1.0, "event": "group", "members": [0, 1]},
              {"t": 1.5, "event": "swept", "member": 1, "head": 0, "requests": 2},
              {"t": 2.0, "event": "rescheduled", "instance": 2},
              {"t": 3.0, "event": "fault", "members": [0, 1]},
              {"t": 9.0, "event": "restore", "members": [0, 1]}]
    assert event_lines(events) == [(1.0, "tab:red"), (9.0, "tab:green")]
