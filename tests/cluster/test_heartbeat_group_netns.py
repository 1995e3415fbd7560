"""A KunServe group across two hosts, one host cut off the network once the group formed (no
FIN, no reset reaches anyone): the front door declares it lost by the heartbeat (default
`Liveness()`), tells the other instance (`PeerLost`), and every request ends: served at the
instance left, equal to transformers', or, having streamed tokens from the lost one, with an
error naming it. Reports how long the instance left took to serve alone again.

Root and iproute2 only, with SHUNTER_NETNS=1:
`sudo SHUNTER_NETNS=1 python -m pytest -q -s tests/cluster/test_heartbeat_group_netns.py`.
"""

from __future__ import annotations

import anyio
import pytest

import shunter
from shunter.cluster.cluster import Cluster
from tests.cluster.netns import netns_hosts  # noqa: F401 (fixture)
from tests.cluster.burst_streams import BurstStreams, burst_jobs
from tests.cluster.test_heartbeat import until_gone
from tests.reference import assert_matches, greedy_reference


@pytest.mark.anyio
@pytest.mark.parametrize("role", ["member", "head"])
async def test_a_host_cut_off_while_grouped_ends_every_request(
        anyio_backend, netns_hosts, kunserve_config, kunserve_model, role):  # noqa: F811
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    from shunter.cluster.launch import LocalLauncher

    longs, burst, jobs = burst_jobs()
    out: dict[str, tuple[list[int], str | None, str | None]] = {}
    with netns_hosts(2) as hosts:
        launcher = LocalLauncher("asyncio", hosts=list(zip(hosts.names, hosts.addresses)))
        try:
            instances = [launcher.start_process(i, kunserve_config) for i in range(2)]
            async with Cluster.start(kunserve_config, attach=instances,
                                     monitor_interval_s=0.02) as cluster:
                cut = None
                with anyio.move_on_after(200) as waited:
                    async with anyio.create_task_group() as tg:
                        head, group = await BurstStreams(cluster, out).until_grouped(
                            tg, longs, burst)
                        cut = head if role == "head" else 1 - head  # instance i is on host i
                        hosts.cut(cut)
                        cut_at = anyio.current_time()
                        lost_at = await until_gone(cluster.instances[cut])
                    ended_at = anyio.current_time()
                assert not waited.cancelled_caught, (
                    f"not done in 200 s: instance {cut} declared lost: "
                    f"{not cluster.instances[cut].alive}; {len(out)} of {len(jobs)} requests "
                    f"ended")
                took = ended_at - cut_at
                print(f"\ngroup {group.members} head {head}; cut host {cut} ({role}); lost "
                      f"{lost_at - cut_at:.2f} s after the cut, every request ended "
                      f"{ended_at - cut_at:.2f} s after it; "
                      f"{sum(1 for r in out.values() if r[1] == 'error')} ended with an error")
                assert len(out) == len(jobs)
                # the silence bound (5 s) and a few seconds, not gloo's 60 s
                assert took < 5.0 + 25.0, f"every request ended only {took:.1f} s after the cut"
                for name, prompt, n in jobs:
                    tokens, reason, error = out[name]
                    if reason == "error":
                        assert error.startswith(f"instance {cut} went silent"), (name, error)
                        continue
                    assert_matches(tokens, greedy_reference(kunserve_model, prompt, n), name)
                again = await cluster.complete(burst[0], shunter.SamplingParams(  # the one left
                    max_tokens=8, temperature=0))
                assert_matches(list(again.token_ids),
                               greedy_reference(kunserve_model, burst[0], 8), "after")
        finally:
            launcher.shutdown(timeout_s=5)
