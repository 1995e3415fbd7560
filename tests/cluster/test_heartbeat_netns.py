"""A host cut off the network while its instance serves: two instance processes, each on a host
of its own (a network namespace, tests/cluster/netns.py), the front door on the bridge. Host 1's
link goes down while it streams requests and while new ones are dispatched to it; its process
lives on and no FIN or reset reaches the front door, so only the heartbeat can find it. With the
default `Liveness()`: it is declared lost within `silent_after_s` (plus the front door's own
lateness), every request ends (served at instance 0 equal to transformers', or, having streamed
tokens, with an error naming instance 1 and that it went silent), and instance 0 serves on.

Root and iproute2 only, with SHUNTER_NETNS=1:
`sudo SHUNTER_NETNS=1 python -m pytest -q tests/cluster/test_heartbeat_netns.py`.
"""

from __future__ import annotations

import os

import anyio
import pytest

from shunter.cluster.cluster import Cluster
from shunter.cluster.heartbeat import Liveness
from tests.cluster.netns import netns_hosts  # noqa: F401 (fixture)
from tests.cluster.prompts import PROMPTS
from tests.cluster.test_heartbeat import _check_equal, _serve, until_gone


@pytest.mark.anyio
async def test_a_host_cut_off_is_lost_within_the_silence_and_the_other_serves_on(
        anyio_backend, netns_hosts, cluster_config, tiny_llama_dir):  # noqa: F811
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    from shunter.cluster.launch import LocalLauncher

    liveness = Liveness()
    with netns_hosts(2) as hosts:
        launcher = LocalLauncher("asyncio", hosts=list(zip(hosts.names, hosts.addresses)))
        try:
            instances = [launcher.start_process(i, cluster_config) for i in range(2)]
            async with Cluster.start(cluster_config, attach=instances,
                                     monitor_interval_s=0.02) as cluster:
                handle = cluster.instances[1]
                prompts = PROMPTS[:16]
                results: dict = {}
                late: dict = {}
                streamed = anyio.Event()
                cut_at = lost_at = None

                def on_chunk(key: int, tokens: list[int]) -> None:
                    if tokens and cluster._where.get(key, (None,))[0] == 1:
                        streamed.set()

                async def watch_down() -> None:
                    nonlocal lost_at
                    lost_at = await until_gone(handle)

                dispatched_before = cluster.table.dispatches
                with anyio.move_on_after(120) as waited:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(_serve, cluster, prompts[:10], results, on_chunk)
                        await streamed.wait()
                        hosts.cut(1)
                        cut_at = anyio.current_time()
                        os.kill(instances[1].pid, 0)  # alive, and now unreachable
                        tg.start_soon(watch_down)
                        await _serve(cluster, prompts[10:], late)
                assert not waited.cancelled_caught, (
                    f"requests did not end in 120 s after host 1 was cut off: not declared lost "
                    f"(failure {handle.failure!r}, {handle.heartbeat.pings} pings)")
                results.update({10 + i: r for i, r in late.items()})
                took = lost_at - cut_at
                print(f"lost {took:.2f} s after the cut; longest answer wait before: "
                      f"{handle.heartbeat.longest_wait_s:.3f} s")
                assert liveness.silent_after_s <= took < liveness.silent_after_s + 5.0, took
                assert handle.failure.startswith("instance 1 went silent: no answer to a ping ")
                assert len(results) == len(prompts)
                failed = {i for i, r in results.items() if r[1] == "error"}
                for i in failed:
                    tokens, _, error = results[i]
                    assert tokens and error.startswith("instance 1 went silent"), (i, error)
                _check_equal({i: r for i, r in results.items() if i not in failed}, prompts,
                             tiny_llama_dir, "served")
                redispatched = cluster.table.dispatches - dispatched_before - len(prompts)
                assert redispatched >= 1, "requests it had not streamed from went to instance 0"
                again: dict = {}
                await _serve(cluster, PROMPTS[20:26], again)
                _check_equal(again, PROMPTS[20:26], tiny_llama_dir, "after")
                assert [v.alive for v in (await cluster.inspect()).views] == [True, False]
            # the front door ended the lost instance's process (this machine can reach it)
            assert "killed by signal 9" in instances[1].describe_death()
        finally:
            launcher.shutdown(timeout_s=5)
