"""The KunServe torch benches (bench/kunserve_lookahead_torch.py, bench/kunserve_fifo_torch.py)
with degenerate arguments: refused up front with the argument named (before any process
starts), and a report with nothing measured for a metric prints `n/a` (`--warmup 0` leaves the
Eq. 1-3 fits unfitted, so no prediction error is measured: the report crashed formatting None)."""

from __future__ import annotations

import pytest

from bench import kunserve_fifo_torch as fifo
from bench import kunserve_lookahead_torch as lookahead


def test_a_report_with_nothing_measured_prints_n_a():
    nothing = dict.fromkeys(("bubble_prefill", "bubble_all", "wall_bubble_prefill",
                             "wall_bubble_all", "prediction_error_mean",
                             "prediction_error_median", "prediction_error_prefill_steps",
                             "prediction_error_decode_steps", "tokens_model_error_mean",
                             "tokens_model_error_prefill_steps"))
    line = lookahead.report_line("lookahead", {**nothing, "bubble_all": 0.25})
    assert "all 0.250" in line and line.count("n/a") == 9, line
    assert lookahead._ratio([], prefill_only=False, wall=False) is None  # not a 0% bubble


@pytest.mark.parametrize(("bench", "argv", "message"), [
    (lookahead, ["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (lookahead, ["--layers", "1"], "--layers must be at least 2, got 1"),
    (lookahead, ["--microbatches", "0"], "--microbatches must be at least 1, got 0"),
    (lookahead, ["--hidden", "40"], "--hidden must be a multiple of 16"),
    (lookahead, ["--decodes", "600"], "--decodes must be at most 543"),
    (fifo, ["--steps", "1"], "--steps must be at least 2, got 1"),
    (fifo, ["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (fifo, ["--old", "32"], ("--old 32 requests of --old-tokens 512 need 1024 blocks of 16 "
                             "tokens; the pool has --blocks 640")),
])
def test_degenerate_arguments_are_refused_naming_them(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_defaults_and_the_smallest_useful_runs_are_accepted():
    assert lookahead.parse_args(["--rounds", "1", "--warmup", "0", "--decodes", "0"]).rounds == 1
    assert fifo.parse_args(["--old", "32", "--blocks", "1200"]).old == 32
