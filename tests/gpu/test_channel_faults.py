"""What waits in a group's channel when the group breaks (gpu/plane_links.py `Held`): three
ranks of the data plane in one process (threads, each rank its own gloo process group), each
with a stand-in watch the test marks as the front door's `PeerLost` would.

- A send and a receive already posted when a member is found silent end as soon as the watch
  knows (gloo's own wait is the plane's `timeout_s`), naming the member and why.
- A channel closed as broken while both ends wait in it ends both waits at once.
Planted bugs, each run by hand (quoted in the s27 report): `Held` built without the watch
(`lost=None`) makes the first test wait out `timeout_s`; `release` not breaking the process
group makes the second wait out `timeout_s` at both ends."""

from __future__ import annotations

import threading
import time

import torch

from gpu.data_plane import GroupMemberLost
from tests.gpu.test_data_plane_channels import _open_all, _planes

TIMEOUT_S = 40.0
"""The planes' gloo timeout: every bound below is far under it."""
BOUND_S = 15.0


class StandInWatch:
    def __init__(self) -> None:
        self.gone: set[int] = set()

    def lost(self, ranks):
        return [r for r in ranks if r in self.gone]

    def mark_lost(self, rank: int) -> None:
        self.gone.add(rank)

    def why(self, rank: int) -> str:
        return "the front door found it silent"


def _watched_planes(n: int):
    planes = _planes(n, timeout_s=TIMEOUT_S)
    for p in planes:
        p.watch = StandInWatch()
    return planes


def _timed(fn, out: dict, name: str) -> threading.Thread:
    def run() -> None:
        began = time.monotonic()
        try:
            fn()
            out[name] = (time.monotonic() - began, None)
        except Exception as exc:  # noqa: BLE001 (the test looks at it)
            out[name] = (time.monotonic() - began, exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_waits_posted_to_a_member_found_silent_end_when_the_watch_knows():
    planes = _watched_planes(3)
    a, b, c = _open_all(planes, "0.40", (0, 1, 2))
    for ch in (a, b, c):
        assert not isinstance(ch, Exception), ch
    out: dict = {}
    # rank 0: an activation to rank 2 (which never receives it: its host was cut) and a
    # receive from rank 1 (which will never send: the group is broken)
    a.queue.put_activation(torch.ones(8), dst=2, tag=3)
    waits = [_timed(a.queue.flush, out, "send"),
             _timed(lambda: a.recv_tensor(torch.zeros(4), 1, 4, "a test's step"), out, "recv"),
             _timed(lambda: b.recv_tensor(torch.zeros(4), 0, 5, "a test's step"), out, "peer")]
    time.sleep(1.0)  # all posted and waiting
    assert not out, out
    planes[0].watch.mark_lost(2)  # the front door's PeerLost
    marked = time.monotonic()
    for t in waits:
        t.join(timeout=TIMEOUT_S + 20)
    took = time.monotonic() - marked
    assert set(out) == {"send", "recv", "peer"}, out
    assert took < BOUND_S, f"the waits ended {took:.1f} s after the watch knew ({out})"
    send_s, send_err = out["send"]
    assert send_err is not None and "instance 2 was lost" in str(send_err) \
        and "the front door found it silent" in str(send_err), send_err
    recv_s, recv_err = out["recv"]
    assert isinstance(recv_err, GroupMemberLost) and recv_err.rank == 2, recv_err
    assert "a test's step: RuntimeError: the front door found it silent" in str(recv_err)
    # rank 1 (which does not know yet) stops waiting too: rank 0's connections closed
    peer_s, peer_err = out["peer"]
    assert isinstance(peer_err, GroupMemberLost) and "Connection closed" in str(peer_err), \
        peer_err
    assert a.held.breaks == 1
    # and rank 0 posts nothing more on the broken channel
    began = time.monotonic()
    try:
        a.recv_tensor(torch.zeros(1), 1, 6, "a later step")
    except GroupMemberLost as exc:
        assert "instance 2 was lost while a later step" in str(exc), exc
    assert time.monotonic() - began < 1.0
    for ch in (a, b, c):
        ch.close(broken=True)


def test_a_broken_close_ends_the_waits_at_both_ends():
    """Both members still wait in the channel of a group that broke (each for a tensor the
    other never sends); rank 0 closes it as broken: its own wait and rank 1's end at once
    (before: each waited out gloo's timeout, a waiting operation keeping its side open)."""
    planes = _watched_planes(2)
    a, b = _open_all(planes, "0.41", (0, 1))
    out: dict = {}
    waits = [_timed(lambda: a.recv_tensor(torch.zeros(4), 1, 7, "a test"), out, "mine"),
             _timed(lambda: b.recv_tensor(torch.zeros(4), 0, 8, "a test"), out, "peer")]
    time.sleep(1.0)
    assert not out, out
    closed = time.monotonic()
    a.close(broken=True)
    for t in waits:
        t.join(timeout=TIMEOUT_S + 20)
    took = time.monotonic() - closed
    assert set(out) == {"mine", "peer"}, out
    assert took < BOUND_S, f"the waits ended {took:.1f} s after the close ({out})"
    assert "was closed (the group broke)" in str(out["mine"][1]), out
    assert "Connection closed" in str(out["peer"][1]), out
    b.close(broken=True)


def test_a_control_message_waiting_on_a_member_found_silent_ends_and_leaves_the_world_whole():
    """Three instance processes: rank 0 waits for a control message from rank 1 (silent: it never
    sends); the front door's `PeerLost` ends the wait at once, and the receive left posted never
    times out, so rank 0 still talks to rank 2 after the world's gloo timeout (4 s) has passed
    (a gloo timeout closes all of the world's connections at that instance). Planted bug, run by
    hand: the left receive waited with gloo's own timeout (`first.wait()` in `recv_obj`) fails
    the last assert (rank 0's world closed, rank 2 ended: "instance 2 was lost while a message
    to rank 2: RuntimeError: its process is gone")."""
    import json
    import os
    import subprocess
    import sys

    from gpu.data_plane import free_port

    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.gpu.world_fault_driver", str(r),
                               str(port)], cwd=root, stdout=subprocess.PIPE, text=True)
             for r in range(3)]
    try:
        printed, _ = procs[0].communicate(timeout=150)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = json.loads(printed.strip().splitlines()[-1])
    assert "instance 1 was lost while a step's answer was due: RuntimeError: the front door " \
           "found it silent" in out.get("lost", ""), out
    assert out["lost_after_s"] < 1.0 + BOUND_S, out
    assert out["left"] == 1, out
    assert out.get("answer") == "re: hello", out
