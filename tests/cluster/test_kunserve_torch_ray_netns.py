"""Ray across hosts: a Ray head on one host and a worker raylet on another (network namespaces
with their own addresses, tests/cluster/netns.py; `ray start --head` on host 0, `ray start
--address=HOST0:PORT` on host 1, one CPU each), the front door a Ray driver on host 0
(tests/cluster/ray_netns_driver.py). Ray places one instance actor on each host; the burst forms
a group across them (the data plane meets at instance 0's host, gloo listens on the address
each instance reaches it from), exchanges KV, restores, and every request gives transformers'
greedy tokens; each instance's gloo links run between the two hosts' addresses.

Root, iproute2 and Ray, with SHUNTER_NETNS=1; about a minute (two raylets start on 2 cores).
The Ray processes are ended by their ids (`ip netns pids`), never by `ray stop`, which would
end every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.cluster.netns import netns_hosts  # noqa: F401 (fixture)
from tests.cluster.test_kunserve_torch_cluster import BURST_TOKENS, LONG_TOKENS
from tests.reference import assert_matches, greedy_reference

RAY_PORT = 6379


def _in(host: str, *cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", host, *cmd], capture_output=True, text=True,
                          **kw)


@contextlib.contextmanager
def ray_nodes(hosts, root: str):
    """A Ray head on hosts' first, a worker node on the second; ended (by pid) on exit."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    head = f"{hosts.addresses[0]}:{RAY_PORT}"
    try:
        for i, (name, addr) in enumerate(zip(hosts.names, hosts.addresses)):
            where = (["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] if i == 0
                     else [f"--address={head}"])
            done = _in(name, ray, "start", *where, f"--node-ip-address={addr}", "--num-cpus=1",
                       "--disable-usage-stats", f"--temp-dir={root}/n{i}", env=env,
                       timeout=180)
            assert done.returncode == 0, (name, done.stdout[-2000:], done.stderr[-2000:])
        yield head
    finally:
        for name in reversed(hosts.names):  # the processes on these hosts are this test's
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.5)


@pytest.mark.anyio
async def test_ray_places_instances_on_two_hosts_and_a_group_forms_across_them(
        anyio_backend, netns_hosts, kunserve_config, kunserve_model):  # noqa: F811
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the Ray cluster is the expensive part")
    pytest.importorskip("ray", reason="Ray is the cluster extra")
    root = tempfile.mkdtemp(prefix="shray")  # short: Ray's socket paths must stay short
    try:
        with netns_hosts(2) as hosts, ray_nodes(hosts, root) as head:
            config = os.path.join(root, "config.pkl")
            with open(config, "wb") as f:
                pickle.dump(kunserve_config, f)
            done = _in(hosts.names[0], sys.executable, "-m", "tests.cluster.ray_netns_driver",
                       config, head, env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"),
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                       timeout=400)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout[-3000:], done.stderr[-5000:])
    out = json.loads(lines[0][len("RESULT "):])
    report = out["report"]
    print(f"\nray hosts {out['hosts']}, nodes {out['nodes']}; {report}")
    assert out["hosts"] == list(hosts.addresses), out["hosts"]  # one instance on each host
    assert len(set(out["nodes"])) == 2, out["nodes"]
    assert report["groups_formed"] >= 1 and report["kv_exchanged_bytes"] > 0, report
    assert report["restores"] >= 1, report
    a, b = hosts.addresses
    for i, (me, peer) in enumerate([(a, b), (b, a)]):
        gloo = [c for c in out["links"][i] if c[2] == peer]
        assert gloo and all(c[0] == me for c in gloo), (i, out["links"][i])
        assert not [c for c in out["links"][i] if c[0].startswith("127.")
                    and c[2] in (a, b)], out["links"][i]
    for name, prompt, n in [*((f"L{i}", p, LONG_TOKENS) for i, p in enumerate(out["longs"])),
                            *((f"B{i}", p, BURST_TOKENS) for i, p in enumerate(out["burst"]))]:
        assert_matches(out["got"][name], greedy_reference(kunserve_model, prompt, n), name)
