"""TorchSwapper on the CPU: real copies between two host buffers, counted, ordered on conflicts."""

from __future__ import annotations

import threading

import pytest
import torch

from gpu.swap import TorchSwapper, coalesce
from tests.gpu.swap_doubles import ConflictBlindSwapper, FailingSwapper, GatedSwapper

LAYERS = 3


def arena(blocks: int = 16) -> torch.Tensor:
    return torch.randn(blocks, LAYERS, 2, 4, 2, 8)  # [blocks, L, k/v, slot, head, dim]


def test_coalesce_joins_runs_consecutive_on_both_sides():
    assert coalesce([(4, 0), (5, 1), (6, 2), (9, 3), (10, 7)]) == [(4, 0, 3), (9, 3, 1), (10, 7, 1)]


def test_round_trip_and_copy_counts_per_granularity():
    # per-block: 2 * layers calls per block each way; groups: 2 runs out, 1 run back in
    for granularity, calls in (("per-block", 2 * 4 * LAYERS * 2), ("groups", 3)):
        dev = arena()
        want = dev[[3, 4, 5, 9]].clone()
        sw = TorchSwapper(dev, 8)
        sw.submit(1, "out", [(3, 0), (4, 1), (5, 2), (9, 3)], granularity)
        sw.wait([1])
        dev[[3, 4, 5, 9]] = 0
        sw.submit(2, "in", [(10, 0), (11, 1), (12, 2), (13, 3)], granularity)
        sw.wait([2])
        assert torch.equal(dev[10:14], want)
        s = sw.stats()
        assert s.copy_calls == calls, granularity
        assert s.bytes_out == s.bytes_in == 4 * dev[0].numel() * 4
        assert sorted(sw.poll()) == [1, 2]
        sw.close()


def test_tickets_sharing_a_block_run_in_submission_order():
    dev = arena()
    sw = GatedSwapper(dev, 4, workers=4, held=lambda pairs: pairs[0] == (0, 0))
    sw.submit(1, "out", [(0, 0)], "groups")     # block 0 -> host 0, held back by the gate
    sw.submit(2, "in", [(7, 0)], "groups")      # reads host 0: must wait for ticket 1
    assert not sw.done(2)
    sw.gate.set()
    sw.wait([2])
    assert torch.equal(dev[7], dev[0])
    sw.close()


def test_wait_blocks_waits_for_exactly_the_tickets_using_them():
    dev = arena()
    sw = GatedSwapper(dev, 4, workers=2, held=lambda pairs: pairs[0][0] == 2)
    want = dev[2].clone()
    sw.submit(1, "out", [(2, 1)], "groups")
    sw.submit(2, "out", [(5, 2)], "groups")
    sw.wait([2])
    assert sw.wait_blocks([5, 6]) == 0          # ticket 2 is done; nothing touches block 6
    threading.Timer(0.05, sw.gate.set).start()
    assert sw.wait_blocks([2]) == 1             # the step may now overwrite block 2
    dev[2] = 0
    sw.wait([1])
    assert torch.equal(sw.host_kv[1], want)
    sw.close()


def test_the_conflict_blind_double_lets_a_step_write_blocks_still_being_copied():
    """The planted bug of tests/shunter/test_fastswitch.py, seen directly: with conflict waits
    skipped, a step overwrites block 2 before its swap-out copied it, and the host copy is wrong."""
    dev = arena()
    sw = ConflictBlindSwapper(dev, 4, copy_delay_s=0.05)
    want = dev[2].clone()
    sw.submit(1, "out", [(2, 1)], "groups")
    assert sw.wait_blocks([2]) == 0             # no wait: the copy is still sleeping
    dev[2] = 0
    sw.wait([1])
    assert not torch.equal(sw.host_kv[1], want)
    assert torch.equal(sw.host_kv[1], torch.zeros_like(want))
    sw.close()


class _StandInEvent:
    """A CUDA event on a machine without one: records who waited on it and how."""

    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1

    def query(self) -> bool:
        return False  # the copy stream has not reached it yet


class _StandInStream:
    def __init__(self) -> None:
        self.waited: list[_StandInEvent] = []

    def wait_event(self, event: _StandInEvent) -> None:
        self.waited.append(event)


def _dispatched_on_a_copy_stream(sw: TorchSwapper, ticket_id: int) -> _StandInEvent:
    """What `_run` leaves on CUDA: the ticket dispatched (its future done) and an event recorded
    on the copy stream that the stream has not reached."""
    ticket = sw._tickets[ticket_id]
    ticket.future.result()
    ticket.event = _StandInEvent()
    return ticket.event


def test_wait_orders_the_compute_stream_after_the_copies_without_blocking_the_host(monkeypatch):
    """Issue 14 item 5: a step's checkpoints and swap-backs are waited for on the device, not
    by the host: `wait` makes the compute stream wait on each ticket's event (as `wait_blocks`
    does) and never synchronizes the event."""
    stream = _StandInStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    dev = arena()
    sw = TorchSwapper(dev, 8)
    sw.submit(1, "out", [(3, 0)], "slots")  # slot 3 of block 0 -> host slot 0
    sw.submit(2, "in", [(2, 5)], "groups")  # no block in common: no worker waits on ticket 1
    events = [_dispatched_on_a_copy_stream(sw, 1), _dispatched_on_a_copy_stream(sw, 2)]
    sw.wait([1, 2])
    assert [e.synchronized for e in events] == [0, 0], "the host blocked on the copies"
    assert stream.waited == events
    assert not sw.done(1) and not sw.done(2)  # still copying on the device: not polled away
    sw.close()


def test_wait_still_raises_for_a_failed_ticket(monkeypatch):
    stream = _StandInStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    sw = FailingSwapper(arena(), 8, fail_calls=frozenset({1}), error=OSError("injected"))
    sw.submit(1, "out", [(3, 0)], "slots")
    with pytest.raises(OSError, match="injected"):
        sw.wait([1])
    assert sorted(sw.poll()) == [1]
    with pytest.raises(RuntimeError, match="swap ticket 1 failed: OSError: injected"):
        sw.wait([1])  # already polled: still raises
    assert stream.waited == []
    sw.close()
