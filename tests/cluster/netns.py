"""Several hosts on this one machine, for the cluster tests that must cross hosts: each host is
a Linux network namespace of its own (its own loopback, its own address), joined to the others
through a veth pair into one bridge in this (the root) namespace, which has the subnet's first
address: a front door running here reaches every host, and the hosts reach each other, only
through the bridge. What listens on a host's 127.0.0.1 is reachable from that host alone, as on
separate machines.

Needs root and iproute2 (`ip`); `netns_hosts` skips the test cleanly without them, and runs
only with SHUNTER_NETNS=1 (it changes the machine's network setup while it runs; everything is
removed at the end, also when the test fails).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import attrs
import pytest


@attrs.frozen
class Hosts:
    names: tuple[str, ...]
    """Each host's network namespace (`ip netns exec NAME ...` runs a command on it)."""
    addresses: tuple[str, ...]
    """Each host's address on the bridge."""
    gateway: str
    """This (root) namespace's address on the bridge: where the front door is reached."""
    links: tuple[str, ...] = ()
    """Each host's veth end on the bridge (in this namespace)."""

    def cut(self, i: int) -> None:
        """Cut host `i` off the network, as a pulled cable or a dead host would: its end of the
        link goes down, so nothing it sends arrives and nothing reaches it (its processes
        live on and its sockets stay open; no FIN, no reset ever reaches a peer)."""
        _ip("link", "set", self.links[i], "down")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def can_make_hosts() -> str:
    """"" when this process can make network namespaces, else why not."""
    if os.environ.get("SHUNTER_NETNS") != "1":
        return "network-namespace hosts run with SHUNTER_NETNS=1 (root and iproute2 needed)"
    if os.geteuid() != 0:
        return "network-namespace hosts need root"
    if shutil.which("ip") is None:
        return "network-namespace hosts need iproute2's `ip`"
    return ""


def _free_subnet(first: int) -> int:
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True,
                            text=True).stdout
    for k in [*range(first, 250), *range(first)]:
        if f"10.231.{k}.0/24" not in routes:
            return k
    raise RuntimeError("no free 10.231.K.0/24 subnet for network-namespace hosts")


_calls = itertools.count()


@contextlib.contextmanager
def make_hosts(n: int) -> Iterator[Hosts]:
    """`n` hosts on one bridge, 10.231.K.2 .. 10.231.K.(n+1) (K the first subnet from this
    process id on that no route of this machine uses yet, so two test runs side by side do not
    share one); removed on exit."""
    # a letter per call: a namespace whose process still runs (a cut host's instance not yet
    # reaped) outlives `netns del` with its veth pair, and the next call must not meet it
    tag = f"{os.getpid() % 100000}{chr(97 + next(_calls) % 26)}"
    k = _free_subnet(os.getpid() % 250)
    bridge = f"shbr{tag}"
    names = tuple(f"shunter-{tag}-{i}" for i in range(n))
    addresses = tuple(f"10.231.{k}.{i + 2}" for i in range(n))
    gateway = f"10.231.{k}.1"
    made: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made.append(bridge)
        _ip("addr", "add", f"{gateway}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, (name, addr) in enumerate(zip(names, addresses)):
            _ip("netns", "add", name)
            made.append(name)
            outer, inner = f"shv{tag}h{i}", f"shv{tag}n{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", name)
            made.append(outer)  # deleted itself: a namespace kept alive keeps its pair
            _ip("link", "set", outer, "master", bridge, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", name, "link", "set", inner, "up")
            _ip("-n", name, "route", "add", "default", "via", gateway)
        yield Hosts(names=names, addresses=addresses, gateway=gateway,
                    links=tuple(f"shv{tag}h{i}" for i in range(n)))
    finally:
        for thing in reversed(made):
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", thing) if thing in names else _ip("link", "del", thing)


@pytest.fixture
def netns_hosts() -> Iterator[Callable[[int], contextlib.AbstractContextManager[Hosts]]]:
    """Skips unless SHUNTER_NETNS=1, root and `ip`; the test calls `make_hosts(n)`."""
    why = can_make_hosts()
    if why:
        pytest.skip(why)
    yield make_hosts
