"""The KunServe timeline plot (`bench/kunserve_plot.py`): what each panel shows is computed
without matplotlib (each instance's group runs, the grey spans with layers dropped, arrivals
per second, the demand the restore rule reads), and without matplotlib the plot says so and
draws nothing. Only the drawing itself needs matplotlib (skipped where it is absent)."""

from __future__ import annotations

import sys

import pytest

from bench import kunserve_plot as kp


def _sample(t, group, dropped, used, pool, demand=None):
    return {"t": t, "group": group, "dropped_layers": dropped, "used": used, "pool": pool,
            "queued_tokens": 0, "demand": demand}


ALONE = ([0, 1], [0, 0])
PAIR = ([0, 0], [16, 16])  # instance 0 heads a group of (0, 1)
SAMPLES = [_sample(0.0, *ALONE, [0, 0], [100, 100], 0.0),
           _sample(1.0, *PAIR, [150, None], [250, 0], 0.9),
           _sample(2.0, *PAIR, [120, None], [250, 0], 0.6),
           _sample(3.0, *ALONE, [10, 5], [100, 100], 0.075)]


def test_each_instance_s_runs_last_until_the_sample_that_changes_them():
    runs = kp.segments(SAMPLES)
    assert runs[1] == [(0.0, 1.0, 1, 0), (1.0, 3.0, 0, 16), (3.0, 3.0, 1, 0)]
    assert runs[0] == [(0.0, 1.0, 0, 0), (1.0, 3.0, 0, 16), (3.0, 3.0, 0, 0)]


def test_grey_spans_cover_the_time_with_layers_dropped_to_the_end_if_never_restored():
    assert kp.grouped_spans(SAMPLES) == [(1.0, 3.0)]
    assert kp.grouped_spans(SAMPLES[:3]) == [(1.0, 2.0)]
    assert kp.grouped_spans(SAMPLES[:1]) == []


def test_arrivals_are_counted_per_second_bin():
    xs, rates = kp.arrivals_per_s([(0.1, 1.0), (0.9, 2.0), (2.5, 0.3)])
    assert xs == [0.0, 1.0, 2.0] and rates == [2.0, 0.0, 1.0]
    assert kp.arrivals_per_s([(0.1, 1.0), (0.9, 2.0)], bin_s=0.5)[1] == [2.0, 2.0]


def test_the_demand_shown_is_the_restore_rule_s_own_when_recorded():
    assert kp.demand_series(SAMPLES) == ([0.0, 1.0, 2.0, 3.0], [0.0, 0.9, 0.6, 0.075], True)
    old = [dict(s, demand=None) for s in SAMPLES]  # reports before round 9: KV held only
    ts, held, own = kp.demand_series(old)
    assert not own and held == [0.0, 0.75, 0.6, 0.075]  # over the first sample's 200 blocks


def test_the_restore_threshold_and_the_last_arrival_are_read_from_the_run():
    assert kp.restore_threshold("kv_usage < 40% for 4s") == 0.4
    assert kp.restore_threshold(None) is None
    assert kp.last_arrival([(0.1, 1.0), (7.5, 0.2), (3.0, 9.0)]) == 7.5
    assert kp.last_arrival([]) is None


def _report():
    cluster = {"kv_usage": SAMPLES, "drops": 1, "restores": 1,
               "events": [{"t": 1.0, "event": "group"}, {"t": 3.0, "event": "restore"}]}
    run = {"cluster": cluster, "ttft_series": [(0.1, 0.2), (1.5, 0.4)], "ttft_p99_s": 0.4,
           "restore_rule": "kv_usage < 50% for 4s", "code": "abc"}
    return {"workload": "azure-conv:start=0,duration=3,rate=1x", "instances": 2,
            "profile": "p", "runs": {"kunserve": run}}


def test_without_matplotlib_the_plot_says_so_and_draws_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    path = tmp_path / "t.png"
    assert kp.plot(_report(), path) is False
    assert not path.exists() and "matplotlib is not installed" in capsys.readouterr().out


def test_a_report_without_a_kunserve_cluster_block_draws_nothing(tmp_path):
    assert kp.plot({"runs": {"vllm_dp": {}}}, tmp_path / "t.png") is False


def test_the_plot_is_drawn_where_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib",
                        reason="the timeline needs matplotlib: pip install -e '.[plot]'")
    path = tmp_path / "t.png"
    assert kp.plot(_report(), path) is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
