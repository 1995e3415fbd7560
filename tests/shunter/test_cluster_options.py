"""`--silent-after` and `--front-door-silent-after` reach the cluster as the `Liveness` they
name (shunter/commands/cluster_options.py); bad values are refused by name in
tests/shunter/test_cli_errors.py."""

from __future__ import annotations

import argparse

import pytest

from shunter.cluster.heartbeat import Liveness
from shunter.commands.cluster_options import add_cluster_options, liveness


def parsed(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_cluster_options(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "expected"), [
    ((), None),  # the cluster's default, Liveness()
    (("--silent-after", "7"), Liveness(silent_after_s=7.0)),
    (("--silent-after", "0.75"), Liveness(silent_after_s=0.75)),
    (("--silent-after", "0"), Liveness(silent_after_s=None)),  # never
    (("--front-door-silent-after", "20"), Liveness(front_door_silent_after_s=20.0)),
    (("--silent-after", "3", "--front-door-silent-after", "0"), Liveness(silent_after_s=3.0)),
])
def test_silent_after_gives_the_liveness_it_names(argv, expected):
    assert liveness(parsed("--instances", "2", *argv)) == expected
