"""Across machines, an instance's gloo must listen on an address its peers can reach: the one
it reaches the rendezvous (instance 0) from, not what its host name resolves to (loopback on
many machines, this one included: `vm` is 127.0.0.1 here). Two ranks of the data plane's
process groups in one process (threads), over a store at this machine's non-loopback address;
the gloo connections they make are read from /proc (this process's sockets only) and must be
on that address. Planted bug checked by hand: `_process_group` ignoring `address` (gloo's
default device) fails it (its connections are on 127.0.0.1)."""

from __future__ import annotations

import datetime
import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from gpu.data_plane import DataPlane, _process_group, route_address


def _non_loopback() -> str:
    try:  # a UDP socket connected toward a public address: no packet is sent
        ip = route_address("192.0.2.1", 9)
    except OSError:
        pytest.skip("no route off this machine")
    if ip.startswith("127.") or ":" in ip:
        pytest.skip(f"this machine reaches off-host addresses from {ip}")
    return ip


def _my_tcp_connections() -> list[tuple[str, int, str, int]]:
    """(local ip, port, remote ip, port) of this process's established IPv4 TCP sockets."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    out = []
    with open("/proc/self/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] != "01" or cols[9] not in mine:  # 01: ESTABLISHED
                continue
            out.append((*_endpoint(cols[1]), *_endpoint(cols[2])))
    return out


def _endpoint(hexed: str) -> tuple[str, int]:
    addr, port = hexed.split(":")
    return socket.inet_ntoa(bytes.fromhex(addr)[::-1]), int(port, 16)


def test_gloo_listens_on_the_address_that_reaches_the_rendezvous():
    ip = _non_loopback()
    port = 0
    store = dist.TCPStore(ip, port, 2, True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    client = dist.TCPStore(ip, store.port, 2, False, timeout=datetime.timedelta(seconds=30))
    planes = [DataPlane(rank=r, world_size=2, store=s, timeout_s=30, address=ip)
              for r, s in enumerate((store, client))]
    groups: list = [None, None]

    def join(r: int) -> None:
        groups[r] = _process_group(planes[r], "address-test/", r, 2)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
    assert all(g is not None for g in groups), "the two ranks did not meet"
    got = torch.zeros(4)
    recv = groups[1].recv([got], 0, 7)
    groups[0].send([torch.arange(4.0)], 1, 7).wait()
    recv.wait()
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0]
    gloo = [c for c in _my_tcp_connections() if store.port not in (c[1], c[3])]
    assert gloo, "no gloo connection found"
    assert all(c[0] == ip and c[2] == ip for c in gloo), gloo
    for g in groups:
        g.abort()
