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


def test_a_lost_member_reaches_the_compute_thread_as_it_is():
    # a lost group member must stay a GroupMemberLost: the head then recomputes its requests
    # instead of failing them (a fresh-clone CI run failed a request with "the transfer thread
    # failed: pipeline group member instance 1 was lost ...": a RuntimeError the runner did not
    # take for a loss)
    from gpu.data_plane import Channel, GroupMemberLost

    def send(tensor: torch.Tensor, dst: int, tag: int) -> None:
        raise GroupMemberLost(dst, "a tensor was being sent", RuntimeError("its process is gone"))

    q = Channel((0, 1), 0, send, recv=None).queue
    try:
        q.put_activation(torch.zeros(1), dst=1, tag=0)
        with pytest.raises(GroupMemberLost, match="instance 1 was lost"):
            q.flush()
        with pytest.raises(GroupMemberLost):
            q.put_activation(torch.zeros(1), dst=1, tag=1)
    finally:
        q.close()


def _held_sender(hold_tag: int):
    sent: list[int] = []
    started, release = threading.Event(), threading.Event()

    def send(tensor: torch.Tensor, dst: int, tag: int) -> None:
        if tag == hold_tag:  # this activation stays on the wire until released
            started.set()
            release.wait(5)
        sent.append(tag)

    return send, sent, started, release


def test_a_kv_chunk_waits_while_activations_are_queued():
    send, sent, started, release = _held_sender(10)
    q = TransferQueue(send, yield_s=5.0)
    try:
        q.put_activation(torch.zeros(2), dst=1, tag=10)
        assert started.wait(5)
        q.put_activation(torch.zeros(2), dst=1, tag=11)  # queued behind the one on the wire
        q.put(torch.zeros(4), dst=1, tag=0, kind="kv")
        threading.Event().wait(0.1)
        assert sent == []  # the chunk yields to the queued activation
        release.set()
        q.flush()
        assert sent == [10, 11, 0] and q.kv_yields == 1
    finally:
        q.close()


def test_the_yield_is_bounded_so_a_stuck_activation_cannot_hold_kv_forever():
    send, sent, started, release = _held_sender(10)
    q = TransferQueue(send, yield_s=0.05)
    try:
        q.put_activation(torch.zeros(2), dst=1, tag=10)
        assert started.wait(5)
        q.put_activation(torch.zeros(2), dst=1, tag=11)
        q.put(torch.zeros(4), dst=1, tag=0, kind="kv")
        q.flush("kv")  # a receiver waiting for this chunk before it takes activations
        assert sent == [0]
        release.set()
        q.flush()
        assert sent == [0, 10, 11]
    finally:
        q.close()


def test_fifo_sends_everything_in_queue_order_activations_behind_kv():
    """`kv_exchange fifo` (the ablation without coordination): one lane, queue order, so an
    activation queued behind KV chunks waits for all of them (the first test's queue, which
    lets the activations overtake, sends [3, 4, 0, 1, 2])."""
    sent: list[int] = []
    first_started, release = threading.Event(), threading.Event()

    def send(tensor: torch.Tensor, dst: int, tag: int) -> None:
        if tag == 0:
            first_started.set()
            release.wait(5)
        sent.append(tag)

    q = TransferQueue(send)
    q.fifo = True
    try:
        q.put(torch.zeros(4), dst=1, tag=0, kind="kv")
        assert first_started.wait(5)
        q.put(torch.zeros(4), dst=1, tag=1, kind="kv")
        q.put_activation(torch.zeros(2), dst=1, tag=3)
        q.put(torch.zeros(4), dst=1, tag=2, kind="kv")
        threading.Event().wait(0.1)
        assert sent == []  # the activation waits behind the chunk on the wire
        release.set()
        q.flush("activation")
        assert sent[:3] == [0, 1, 3]
        q.flush()
        assert sent == [0, 1, 3, 2]
        assert q.sent_bytes == {"activation": 8, "kv": 48} and q.kv_yields == 0
    finally:
        q.close()
