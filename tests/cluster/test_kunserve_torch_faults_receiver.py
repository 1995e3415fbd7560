"""A KV receiver whose receiving thread fails with anything but a lost member (gpu/kv_exchange.py
`KvReceiver`): every wait for a request still pending raises it, naming the chunk and the
source. Before, only `GroupMemberLost` was kept: any other error ended the thread silently and
the step that waited for the request's chunks waited forever. Stand-in channel, no processes."""

from __future__ import annotations

import threading

import pytest
import torch

import gpu.kv_exchange as kx
from gpu.data_plane import Channel

BOUND_S = 30.0
"""A wait that has not ended by then never will (the stand-in fails at once)."""


def _broken_recv(t: torch.Tensor, src: int, tag: int) -> None:
    raise ValueError("a chunk of 3 blocks, 2 expected")


def test_a_receiving_thread_that_fails_ends_every_wait(monkeypatch):
    monkeypatch.setattr(kx, "known_lost", lambda ranks: [])
    link = Channel((0, 1), 0, lambda *a: None, _broken_recv)
    t = kx.KvTransfer(request_id=7, src=1, dst=0, layers=range(0, 2), blocks=3)
    receiver = kx.KvReceiver((0, 1), 0, [t], 2, 0, (2, 4, 1, 8), torch.float32,
                             kx.ExchangeStats(), link=link)
    box: list[BaseException] = []

    def wait() -> None:
        try:
            receiver.wait(7)
        except BaseException as exc:  # noqa: BLE001 (checked below)
            box.append(exc)

    waiting = threading.Thread(target=wait, daemon=True)  # (daemon: a planted hang stays)
    waiting.start()
    waiting.join(BOUND_S)
    assert not waiting.is_alive(), f"the wait for request 7 still waits after {BOUND_S} s"
    assert len(box) == 1 and isinstance(box[0], RuntimeError), box
    assert str(box[0]) == ("receiving KV chunk 0 of 2 from instance 1 failed: ValueError: "
                           "a chunk of 3 blocks, 2 expected"), str(box[0])
    with pytest.raises(RuntimeError, match="receiving KV chunk 0"):
        receiver.join(BOUND_S)
