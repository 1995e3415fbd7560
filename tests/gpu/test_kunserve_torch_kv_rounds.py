"""A restore prefetch's KV rounds on the head (gpu/restore_kv.py `KvPrefetch`) and the counters
every receiver shares (gpu/kv_exchange.py `ExchangeStats`), with a stand-in channel, no
processes: a round whose step failed is voided (its chunks still come, and are dropped; its
blocks are named again), the restore's wait for rounds still due is bounded and says which,
and bytes counted from several receiving threads at once are all counted."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

import gpu.kv_exchange as kx
import gpu.restore_kv as rk
from engine.messages import ExecuteStep, SeqWork
from gpu.data_plane import Channel, GroupMemberLost

BS, LAYERS = 4, (range(0, 2), range(2, 4))
SHAPE = (2, BS, 1, 8)  # one layer of one block: (K|V, block size, kv heads, head dim)


def _stage(recv) -> SimpleNamespace:
    config = SimpleNamespace(num_kv_heads=SHAPE[2], head_dim=SHAPE[3])
    model = SimpleNamespace(config=config, arena=SimpleNamespace(dtype=torch.float32))
    return SimpleNamespace(model=model, block_size=BS, stats=kx.ExchangeStats(), host_bytes=0,
                           plane=Channel((0, 1), 0, lambda *a: None, recv), seqs={})


def _step(rid: int, start: int, num: int) -> ExecuteStep:
    return ExecuteStep(step_id=1, release=(), setups=(), blocks=(),
                       seqs=(SeqWork(request_id=rid, start=start, num_tokens=num, sample=True),))


class _Member:
    """The member's side of the channel: chunk `seq` (in the KV epoch) is its value `seq`; the
    chunks listed in `held` never come (a member that never sent them)."""

    def __init__(self, held=()) -> None:
        self.held, self.gone = set(held), threading.Event()

    def recv(self, t: torch.Tensor, src: int, tag: int, what: str = "") -> None:
        seq = tag - kx._tag(rk.KV_EPOCH, 0)
        if seq in self.held:
            self.gone.wait()
            raise RuntimeError("channel closed")
        t.fill_(float(seq))


@pytest.fixture
def member(monkeypatch):
    monkeypatch.setattr(kx, "known_lost", lambda ranks: [])
    monkeypatch.setattr(rk, "known_lost", lambda ranks: [])
    made = []
    yield lambda held=(): made.append(_Member(held)) or made[-1]
    for m in made:
        m.gone.set()


def test_a_failed_steps_round_is_voided_and_named_again(member):
    """Request 5 had 1 full block at the prefetch's start (round 0: chunk 0); a step filling
    its blocks 1-2 failed (round 1: chunk 1, what the member sent in its place); the next step
    names blocks 1-2 again (round 2: chunk 2), and the restore writes those, not round 1's."""
    m = member()
    stage = _stage(m.recv)
    kv = rk.KvPrefetch(stage, (0, 1), LAYERS, 2, {5: 1})
    spans = kv.step_spans(_step(5, 4, 8))
    assert spans == {5: (1, 3)}
    kv.add(spans)
    kv.void(spans)
    assert kv.named == {5: 1}, "the failed step's blocks still counted as taken"
    again = kv.step_spans(_step(5, 4, 8))
    assert again == {5: (1, 3)}, "the failed step's blocks were not named again"
    kv.add(again)
    kv.join(30.0)
    assert kv.usable({5: SimpleNamespace(table=[10, 11, 12])}) == {5: 3}
    full = torch.full((3, 4, *SHAPE), -1.0)
    kv.write(full, 5, [0, 1, 2])
    assert full[0, 2:].unique().tolist() == [0.0], "round 0's block"
    assert full[1:, 2:].unique().tolist() == [2.0], (
        f"blocks 1-2 hold round {full[1:, 2:].unique().tolist()}'s chunk, not round 2's")
    assert full[:, :2].unique().tolist() == [-1.0]  # (the head's own layers: not from here)
    kv.close()


def test_the_restores_wait_for_rounds_still_due_is_bounded(member, monkeypatch):
    """A round whose chunk never comes (the member sent none): the wait ends after its bound
    with an error naming the round, the request and the member, not a member's loss (before:
    no bound; gloo's receive timeout, 60 s, then named the live member lost)."""
    stage = _stage(member(held={1}).recv)
    kv = rk.KvPrefetch(stage, (0, 1), LAYERS, 2, {5: 1})
    kv.add(kv.step_spans(_step(5, 4, 4)))
    with pytest.raises(RuntimeError) as err:
        kv.join(0.3)
    assert str(err.value) == ("the restore's prefetched KV: round 1 of 2 still waits for "
                              "requests [5] from members [1] after 0.3 s"), str(err.value)
    monkeypatch.setattr(rk, "known_lost", lambda ranks: [1])  # a member the watch finds gone
    with pytest.raises(GroupMemberLost, match="instance 1 was lost"):
        kv.join(30.0)
    kv.close()


class _SlowStats(kx.ExchangeStats):
    """Its byte counter's read lets other threads run before the write that follows (as a
    thread switch between them may, at any time)."""

    @property
    def received_bytes(self) -> int:
        value = self.__dict__.get("_received", 0)
        time.sleep(0.0005)
        return value

    @received_bytes.setter
    def received_bytes(self, value: int) -> None:
        self.__dict__["_received"] = value


def test_every_chunk_is_counted_when_receivers_count_at_once():
    """Four rounds' receivers take their chunks at the same time (as a prefetch's receiving
    thread per member and the restore's own do), each adding to the stage's one
    `ExchangeStats`: every byte is counted (each receiver counting under its own lock lost
    those another added between its read and its write)."""
    stats, chunks, rounds = _SlowStats(), 40, 4
    link = Channel((0, 1), 0, lambda *a: None, lambda t, src, tag, what="": None)
    t = kx.KvTransfer(request_id=1, src=1, dst=0, layers=range(0, 1), blocks=chunks)
    receivers = [kx.KvReceiver((0, 1), 0, [t], 1, 0, (1,), torch.float32, stats, link=link)
                 for _ in range(rounds)]
    for r in receivers:
        assert r.join(60.0), "a receiving thread did not end"
    assert (stats.chunks_received, stats.received_bytes) == (rounds * chunks,
                                                             rounds * chunks * 4)
