"""The per-instance transfer queue: one sending thread, activations ahead of queued KV
(KunServe's KV exchange must not delay a pipeline's activations), in order within a kind."""

from __future__ import annotations

import threading

import pytest
import torch

from gpu.transfer import TransferQueue


def test_activations_overtake_queued_kv_and_order_holds_within_a_kind():
    sent: list[int] = []
    first_started, release = threading.Event(), threading.Event()

    def send(tensor: torch.Tensor, dst: int, tag: int) -> None:
        if tag == 0:  # hold the first KV chunk on the wire so the rest queue up
            first_started.set()
            release.wait(5)
        sent.append(tag)

    q = TransferQueue(send)
    try:
        q.put(torch.zeros(4), dst=1, tag=0, kind="kv")
        assert first_started.wait(5)
        q.put(torch.zeros(4), dst=1, tag=1, kind="kv")
        q.put(torch.zeros(4), dst=1, tag=2, kind="kv")
        q.put_activation(torch.zeros(2), dst=1, tag=3)
        q.put_activation(torch.zeros(2), dst=1, tag=4)
        q.flush("activation")  # while chunk 0 is still held on the wire
        release.set()
        q.flush()
        # the activations went out while chunk 0 was still on the wire; chunks 1, 2 after them
        assert sent == [3, 4, 0, 1, 2]
        assert q.sent_bytes == {"activation": 16, "kv": 48}
    finally:
        q.close()


def test_a_failed_send_is_reported_to_the_compute_thread():
    def send(tensor: torch.Tensor, dst: int, tag: int) -> None:
        raise ConnectionError("peer gone")

    q = TransferQueue(send)
    try:
        q.put_activation(torch.zeros(1), dst=1, tag=0)
        with pytest.raises(RuntimeError, match="the transfer thread failed: peer gone"):
            q.flush()
    finally:
        q.close()
