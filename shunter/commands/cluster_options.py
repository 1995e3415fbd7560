"""`--instances N [--pipeline-stages K] [--cluster local|ray] [--silent-after S]
[--front-door-silent-after S]`: the commands that serve (generate, demo, serve) start one
engine, a pipeline of K stage processes, or a cluster of N instances behind the coordinator,
through `start_engine`."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from engine.config import EngineConfig
from engine.errors import ConfigError
from shunter.commands.common import positive_int
from shunter.engine import Engine


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--instances", type=positive_int, default=1,
                   help="engine instances, each in its own process behind the coordinator "
                        "(1: the engine runs in this process)")
    g.add_argument("--pipeline-stages", type=positive_int, default=1,
                   help="torch backend: run each instance's model as a pipeline of this many "
                        "stage processes, each holding a contiguous range of layers")
    g.add_argument("--pipeline-microbatches", type=positive_int, default=None,
                   help="microbatches each pipelined step is cut into (default: twice the "
                        "stages)")
    g.add_argument("--cluster", default="local", choices=("local", "ray"),
                   help="where instances run: local processes, or Ray actors on the Ray "
                        "cluster RAY_ADDRESS names (a local one if unset; needs the cluster "
                        "extra)")
    g.add_argument("--silent-after", type=silent_after, default=None, metavar="SECONDS",
                   help="instance processes: one that answers no ping (every 0.25 s) for this "
                        "long is lost, as if it had died: its host cut off or its process "
                        "stopped (default 5; 0: never, only a closed link or a dead process)")
    g.add_argument("--front-door-silent-after", type=silent_after, default=None,
                   metavar="SECONDS",
                   help="instance processes: each ends what it holds (its requests cancelled, "
                        "its process ended) once it heard nothing from the front door for "
                        "this long: the front door's host cut off or down (default 0: never)")


def silent_after(text: str) -> float:
    """An argparse type for `--silent-after`: 0 (never), or more than twice the ping interval."""
    from shunter.cluster.heartbeat import Liveness

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    floor = 2 * Liveness().interval_s
    if value != 0 and not value > floor:  # (NaN included)
        raise argparse.ArgumentTypeError(
            f"{text} must be more than {floor:g} s (twice the ping interval), or 0 for never")
    return value


def liveness(args: argparse.Namespace | None) -> Any:
    """The `Liveness` `--silent-after` and `--front-door-silent-after` ask for (None: the
    cluster's default)."""
    seconds = getattr(args, "silent_after", None)
    front = getattr(args, "front_door_silent_after", None)
    if seconds is None and front is None:
        return None
    from shunter.cluster.heartbeat import Liveness

    kw = {} if seconds is None else {"silent_after_s": seconds or None}
    return Liveness(**kw, front_door_silent_after_s=front or None)


def cluster_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the cluster options set."""
    stages = getattr(args, "pipeline_stages", 1)
    if stages == 1:
        return {}
    return {"pipeline_stages": stages,
            "pipeline_microbatches": getattr(args, "pipeline_microbatches", None)}


@contextlib.asynccontextmanager
async def start_engine(config: EngineConfig,
                       args: argparse.Namespace | None) -> AsyncIterator[Any]:
    """An Engine, or a Cluster (the same client API) when `--instances` is more than 1."""
    instances = getattr(args, "instances", 1) if args is not None else 1
    if config.pipeline_stages > 1 and config.backend != "torch":
        raise ConfigError("--pipeline-stages: pipelines of stage processes run on the torch "
                          "backend (the simulator models them: bench/pipeline.py)")
    if instances == 1:
        async with Engine.start(config) as engine:
            yield engine
        return
    from shunter.cluster.cluster import Cluster  # starts processes: only when asked for

    kind = "inprocess" if config.backend == "sim" else args.cluster
    async with Cluster.start(config, instances=instances, kind=kind,
                             liveness=liveness(args)) as cluster:
        yield cluster


def preemptions(snap: Any) -> int:
    """Preemptions in an engine's snapshot, or summed over a cluster's live instances."""
    if hasattr(snap, "snapshots"):
        return sum(s.scheduler.preemptions for s in snap.snapshots if s is not None)
    return snap.scheduler.preemptions
