"""A wait on a member of a pipeline group ends as soon as the data plane's watch finds any
member gone (gpu/kv_exchange.py `known_lost`, `WATCH_SLICE_S`): the KV receiver's `wait` for a
request's chunks and `WatchedRecv` (activations) raise `GroupMemberLost` naming the lost member,
instead of waiting on a live member of the broken group until gloo's timeout. Stand-in channel
(no processes): its receive blocks until released or `STUCK_S` passes (gloo's timeout, short)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import gpu.kv_exchange as kx
from gpu.data_plane import Channel, GroupMemberLost

STUCK_S = 3.0


class StandIn:
    """Member 0 of (0, 1, 2): receives block until `release`; member 2 is 'gone' once `kill`."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.dead: set[int] = set()

    def recv(self, t: torch.Tensor, src: int, tag: int) -> None:
        if not self.released.wait(STUCK_S):
            raise RuntimeError(f"Timed out waiting {STUCK_S} s for recv from {src}")
        t.fill_(float(src))

    def channel(self) -> Channel:
        return Channel((0, 1, 2), 0, lambda *a: None, self.recv)

    def lost(self, ranks) -> list[int]:
        return [r for r in ranks if r in self.dead]


def _receiver(link: Channel) -> kx.KvReceiver:
    t = kx.KvTransfer(request_id=7, src=1, dst=0, layers=range(0, 2), blocks=3)
    return kx.KvReceiver((0, 1, 2), 0, [t], 2, 1, (2, 4, 1, 8), torch.float32,
                         kx.ExchangeStats(), link=link)


def _kill_later(stand: StandIn, after_s: float) -> None:
    threading.Timer(after_s, stand.dead.add, args=(2,)).start()


@pytest.mark.parametrize("wait_on", ["kv", "activations"])
def test_a_wait_on_a_live_member_ends_once_another_is_gone(monkeypatch, wait_on):
    """Member 0 waits on live member 1 (which never sends: the group is broken); member 2's
    process goes away 0.2 s in. The wait ends within a few watch slices, naming instance 2."""
    stand = StandIn()
    monkeypatch.setattr(kx, "known_lost", stand.lost)
    link = stand.channel()
    _kill_later(stand, 0.2)
    began = time.perf_counter()
    with pytest.raises(GroupMemberLost) as err:
        if wait_on == "kv":
            _receiver(link).wait(7)
        else:
            kx.WatchedRecv(link).recv(torch.empty(4), 1, 5, "activations were due")
    took = time.perf_counter() - began
    stand.released.set()  # (the stand-in's stuck receive ends)
    assert err.value.rank == 2 and "instance 2 was lost" in str(err.value), str(err.value)
    assert took < 0.2 + 10 * kx.WATCH_SLICE_S, (took, str(err.value))


@pytest.mark.parametrize("wait_on", ["kv", "activations"])
def test_a_healthy_wait_returns_the_data(monkeypatch, wait_on):
    """Nothing lost: the chunks (or activations) arrive after a few slices and are returned."""
    stand = StandIn()
    monkeypatch.setattr(kx, "known_lost", stand.lost)
    link = stand.channel()
    threading.Timer(0.1, stand.released.set).start()
    if wait_on == "kv":
        got = _receiver(link).wait(7)
        assert len(got) == 1 and bool((got[0][1] == 1.0).all())
    else:
        x = torch.zeros(4)
        kx.WatchedRecv(link).recv(x, 1, 5, "activations were due")
        assert bool((x == 1.0).all())
