"""A KunServe group's member stops (SIGSTOP: its sockets stay open, as on a host cut off) once
the group formed (the test forms it as the burst arrives: `BurstStreams.until_formed`), and the
front door cannot kill it (as with a host it cannot reach): the front door finds it silent and
tells the head (`PeerLost`), and the head's sends and receives already posted to it end then
(gpu/plane_links.py `Held`), not after gloo's 60 s: every request ends within the silence bound
and a few seconds, served at the head, equal to transformers' (or, having streamed from the
member alone, with the silent error).

Planted bug, run by hand (quoted in the s27 report): the channel's `Held` built without the
watch (`lost=None` in gpu/data_plane.py `open_channel`) fails the bound (the head's posted send
waits gloo's 60 s). (Across network-namespace hosts: test_heartbeat_group_netns.py.)"""

from __future__ import annotations

import os
import signal

import anyio
import attrs
import pytest

from shunter.cluster.cluster import Cluster
from shunter.cluster.heartbeat import Liveness
from tests.cluster.burst_streams import BurstStreams, burst_jobs
from tests.cluster.test_heartbeat import until_gone
from tests.cluster.test_kunserve_torch_moves import by_hand_policy
from tests.reference import assert_matches, greedy_reference

LIVENESS = Liveness()
"""The default (5 s): with 1.5 s a loaded machine (load 10 on 2 cores) once had the head itself
found silent 2 s after the member, as it recomputed every request."""
BOUND_S = LIVENESS.silent_after_s + 25.0
"""Every request ends within this of the stop (gloo's own wait is 60 s)."""


@pytest.mark.anyio
async def test_a_member_stopped_while_grouped_ends_every_request_within_the_silence(
        anyio_backend, kunserve_config, kunserve_model, tmp_path):
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    from shunter.cluster.launch import LocalLauncher

    longs, burst, jobs = burst_jobs()
    out: dict[str, tuple[list[int], str | None, str | None]] = {}
    config = attrs.evolve(kunserve_config, policy=by_hand_policy(tmp_path))
    launcher = LocalLauncher("asyncio")
    started = [await anyio.to_thread.run_sync(launcher.start_process, i, config)
               for i in range(2)]
    unreachable = [attrs.evolve(up, kill=lambda: None) for up in started]
    stopped = None
    try:
        async with Cluster.start(config, attach=unreachable, monitor_interval_s=0.02,
                                 liveness=LIVENESS) as cluster:
            with anyio.move_on_after(240) as waited:
                async with anyio.create_task_group() as tg:
                    head, group = await BurstStreams(cluster, out).until_formed(tg, longs, burst)
                    stopped = 1 - head
                    os.kill(started[stopped].pid, signal.SIGSTOP)
                    stopped_at = anyio.current_time()
                    lost_at = await until_gone(cluster.instances[stopped])
                ended_at = anyio.current_time()
            assert not waited.cancelled_caught, (
                f"not done in 240 s: {len(out)} of {len(jobs)} requests ended")
            took = ended_at - stopped_at
            print(f"\ngroup {group.members} head {head}; member {stopped} stopped; lost "
                  f"{lost_at - stopped_at:.2f} s after the stop, every request ended "
                  f"{took:.2f} s after it")
            assert len(out) == len(jobs)
            assert took < BOUND_S, f"every request ended only {took:.1f} s after the stop"
            for name, prompt, n in jobs:
                tokens, reason, error = out[name]
                if reason == "error":  # streamed from the member found silent: never the
                    # head (it answered no ping for over 5 s as it recovered, once in 9 runs at
                    # load 8-10, while its loop drew the step's failure as a rich traceback:
                    # instance processes print tracebacks plainly, test_heartbeat_logging.py)
                    assert error.startswith(f"instance {stopped} went silent"), (name, error)
                    continue
                assert_matches(tokens, greedy_reference(kunserve_model, prompt, n), name)
    finally:
        for up in started:
            if stopped is not None:
                os.kill(up.pid, signal.SIGKILL)  # stopped or not: ends it
        launcher.shutdown(timeout_s=5)
