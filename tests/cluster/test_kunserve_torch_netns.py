"""KunServe groups across hosts: each instance process runs on a host of its own (a network
namespace with its own address, tests/cluster/netns.py), the front door (this process) on a
third, the bridge's. Nothing is shared but the bridge: each host's loopback is its own, so an
address that only works on loopback fails here as it would across machines.

Checked: the control links go to each host's address; the data plane meets at instance 0's host
and each instance's gloo listens on the address it reaches instance 0 from (gpu/data_plane.py
`route_address`): the gloo connections read from each instance's /proc are between the two
hosts' addresses; the burst forms a group across the hosts, exchanges KV, restores, and every
request gives transformers' greedy tokens.

Root and iproute2 only, with SHUNTER_NETNS=1 (it adds namespaces and a bridge while it runs):
`sudo SHUNTER_NETNS=1 python -m pytest -q tests/cluster/test_kunserve_torch_netns.py`.
"""

from __future__ import annotations

import os
import random
import socket

import anyio
import pytest

from shunter.cluster.cluster import Cluster
from tests.cluster.netns import netns_hosts  # noqa: F401 (fixture)
from tests.cluster.test_kunserve_torch_faults import (  # noqa: F401 (fixtures)
    by_hand_config,
    fifo_config,
)
from tests.cluster.test_kunserve_torch_cluster import (BURST_TOKENS, LONG_TOKENS, _long_then_burst,
                                                    _prompt)
from tests.reference import assert_matches, greedy_reference


def tcp_connections(pid: int) -> list[tuple[str, int, str, int]]:
    """(local ip, port, remote ip, port) of process `pid`'s established IPv4 TCP sockets, read
    in its own network namespace (/proc/PID/net/tcp)."""
    mine = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    out = []
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] == "01" and cols[9] in mine:  # 01: ESTABLISHED
                out.append((*_endpoint(cols[1]), *_endpoint(cols[2])))
    return out


def _endpoint(hexed: str) -> tuple[str, int]:
    addr, port = hexed.split(":")
    return socket.inet_ntoa(bytes.fromhex(addr)[::-1]), int(port, 16)


@pytest.mark.anyio
async def test_a_group_forms_across_hosts_with_transformers_outputs(
        anyio_backend, netns_hosts, kunserve_config, kunserve_model):  # noqa: F811
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    from shunter.cluster.launch import LocalLauncher

    rng = random.Random(0)
    longs = [_prompt(rng, 8) for _ in range(2)]
    burst = [_prompt(rng, 16) for _ in range(12)]
    got: dict[str, list[int]] = {}
    with netns_hosts(2) as hosts:
        launcher = LocalLauncher("asyncio", hosts=list(zip(hosts.names, hosts.addresses)))
        try:
            instances = [launcher.start_process(i, kunserve_config) for i in range(2)]
            assert [up.host for up in instances] == list(hosts.addresses)
            async with Cluster.start(kunserve_config, attach=instances,
                                     monitor_interval_s=0.02) as cluster:
                with anyio.fail_after(300):
                    await _long_then_burst(cluster, longs, burst, got, {})
                    await cluster.wait_idle()
                    while cluster.groups.groups or cluster.groups.busy:
                        await anyio.sleep(0.01)
                report = cluster.groups.report(0.0)
                links = [tcp_connections(up.pid) for up in instances]
        finally:
            launcher.shutdown(timeout_s=10)
    print(f"\nhosts {hosts.addresses} (front door {hosts.gateway}); {report}")
    assert report["groups_formed"] >= 1 and report["kv_exchanged_bytes"] > 0, report
    assert report["restores"] >= 1, report
    a, b = hosts.addresses
    for i, (me, peer) in enumerate([(a, b), (b, a)]):
        # the control link from the front door, and gloo's links (the world and the group's
        # channel) to the other host; nothing on loopback (instance 0's store is on its host's
        # address too: instance 1 reached it there)
        assert any(c[0] == me and c[2] == hosts.gateway for c in links[i]), (i, links[i])
        gloo = [c for c in links[i] if c[2] != hosts.gateway]
        assert gloo and all(c[0] == me and c[2] == peer for c in gloo), (i, links[i])
    for name, prompt, n in [*((f"L{i}", p, LONG_TOKENS) for i, p in enumerate(longs)),
                            *((f"B{i}", p, BURST_TOKENS) for i, p in enumerate(burst))]:
        assert_matches(got[name], greedy_reference(kunserve_model, prompt, n), name)


@pytest.mark.anyio
async def test_a_member_dead_as_it_opens_the_channel_is_seen_across_hosts(
        anyio_backend, netns_hosts, by_hand_config, kunserve_model, monkeypatch):  # noqa: F811
    """test_kunserve_torch_channel_open.py's case with the two instances on two hosts: the
    head's watch connection to the member, across the bridge, ends as the member's process is
    killed, and the group is given up at once."""
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    from shunter.cluster.launch import LocalLauncher
    from tests.cluster.test_kunserve_torch_channel_open import given_up, start_doomed

    with netns_hosts(2) as hosts:
        launcher = LocalLauncher("asyncio", hosts=list(zip(hosts.names, hosts.addresses)))
        try:
            instances = start_doomed(launcher, by_hand_config, monkeypatch)
            took = await given_up(by_hand_config, instances, kunserve_model)
        finally:
            launcher.shutdown(timeout_s=10)
    print(f"\nacross hosts {hosts.addresses}: given up {took:.2f} s after `form` began")
