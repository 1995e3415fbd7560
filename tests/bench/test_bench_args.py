"""The benches' selection flags, as the README's short runs use them: a name that is not one of
the bench's runs is refused at once, naming what there is (bench/kunserve.py `--only` ran
nothing and then failed drawing its table; bench/kunserve_restore.py `--only` wrote an empty
report; bench/bros_sched_share.py `--points 4` raised an IndexError). A valid selection gets
past the check to the workload (stubbed here, so no run starts)."""

from __future__ import annotations

import sys

import pytest

from bench import bros_sched_share, kunserve, kunserve_restore


class _Reached(Exception):
    """The bench got past its argument checks to the workload."""


def _stop(*_args, **_kwargs):
    raise _Reached


def _main(monkeypatch, module, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    module.main()


@pytest.mark.parametrize("module, flag, bad, good, names", [
    (kunserve, "--only", "kunserve,nosuch", "vllm_dp,kunserve", "memory_oracle"),
    (kunserve_restore, "--only", "never", "never (kunserve_lookahead),for 4s",
     "'40% for 4s'"),
])
def test_an_unknown_run_name_is_refused_naming_the_runs(monkeypatch, capsys, tmp_path, module,
                                                         flag, bad, good, names):
    monkeypatch.setattr(module, "trace_workload", _stop)
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, module, flag, bad, "--out", str(tmp_path / "r"))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert f"{flag}: no " in err and repr(bad.split(",")[-1]) in err and names in err, err
    assert not list(tmp_path.iterdir())  # nothing written
    with pytest.raises(_Reached):
        _main(monkeypatch, module, flag, good, "--out", str(tmp_path / "r"))


@pytest.mark.parametrize("points", ["4", "4:x", "12:3500,5"])
def test_sched_share_points_must_be_rate_blocks_pairs(monkeypatch, capsys, tmp_path, points):
    monkeypatch.setattr(bros_sched_share, "measure", _stop)
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, bros_sched_share, "--points", points, "--out", str(tmp_path))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--points: RATE:BLOCKS pairs" in err and repr(points) in err
    with pytest.raises(_Reached):
        _main(monkeypatch, bros_sched_share, "--points", "12:3500,5:1200", "--out", str(tmp_path))
