"""The checks of tests/sim/test_chaos_bros_sim.py catch what they are for: each plant below
breaks one thing a cancel or an ending must undo (or the table's bookkeeping the step relies
on), and the chaos runs must report it, with the message named here, within a few seeds."""

from __future__ import annotations

import pytest

from actors.scheduler import Scheduler
from actors.swap_pool import SwapPool
from engine.bidirectional_step import BidirectionalMemory
from engine.memory.bidirectional import BidirectionalBlocks
from tests.sim.test_chaos_bros_sim import problems, run


def _free_keeping_one_host_slot(self, rid):
    """The request ends, but one of its host slots (checkpoint or swapped KV) is not given back."""
    s = self._seqs[rid]
    if s.host:
        s.host.pop(next(iter(s.host)))
    _free_table(self, rid)


def _free_keeping_the_copy_space(self, rid):
    self._seqs[rid].copy = []
    _free_table(self, rid)


def _free_still_displaced(self, rid):
    self._undisplace = lambda s: None
    try:
        _free_table(self, rid)
    finally:
        del self._undisplace


def _forget_keeping_swapped(self, rid):
    """Release forgets a swapped-out request's table entry (its copy space and host slots)."""
    self._sent.pop(rid, None)
    if rid in self.table and not self.table.swapped(rid):
        self.table.free(rid)


def _forget_keeping_sent(self, rid):
    if rid in self.table:
        self.table.free(rid)


def _release_be_keeping_lost(self, block):
    lost = set(self._blocks[block].lost)
    _release_be(self, block)
    self._blocks[block].lost |= lost


def _checkpoint_one_slot_unwritten(self, block, x, offsets):
    out = _checkpoint(self, block, x, offsets)
    return out[1:] if len(out) > 1 else out  # the slot is marked overwritten, not copied


def _abort_ignoring_displaced(self, rid, reason):
    """A cancel that finds its request displaced (checkpointed slots on the host) is dropped."""
    if self._bidi is not None and rid in self._bidi.table and self._bidi.table.displaced(rid):
        return
    _abort(self, rid, reason)


def _abort_ending_swapped_as_length(self, rid, reason):
    req = self._live.get(rid)
    if req is not None and req.state == "swapped" and not req.in_flight_tokens:
        self._stats.note_cancel(req.state)
        return self._finish(req, "length")
    _abort(self, rid, reason)


def _finish_keeping_swapped_live(self, req, reason, error=None):
    """A cancelled swapped-out request is never finished: it stays live, waiting for more
    blocks than there are to swap back into."""
    if req.state == "swapped" and reason == "cancelled":
        req.swapped_blocks = 10**6
        return
    _finish(self, req, reason, error)


async def _report_keeping_tickets(self):
    pending = dict(self._pending)
    await _report(self)
    self._pending.update(pending)


_free_table, _release_be = BidirectionalBlocks.free, BidirectionalBlocks._release_be
_checkpoint = BidirectionalBlocks._checkpoint
_abort, _report, _finish = Scheduler._abort, SwapPool._report, Scheduler._finish

PLANTS = {
    # plant: (class, method, replacement, policy, what the chaos run must report)
    "host slot kept": (BidirectionalBlocks, "free", _free_keeping_one_host_slot, "recompute",
                       "host slots not free"),
    "copy space kept": (BidirectionalBlocks, "free", _free_keeping_the_copy_space, "bros",
                        "copy-space blocks not free"),
    "still displaced": (BidirectionalBlocks, "free", _free_still_displaced, "recompute",
                        "table._displaced not empty"),
    "swapped kept": (BidirectionalMemory, "_forget", _forget_keeping_swapped, "bros",
                     "table still holds requests"),
    "sent kept": (BidirectionalMemory, "_forget", _forget_keeping_sent, "recompute",
                  "tables still sent for"),
    "lost kept": (BidirectionalBlocks, "_release_be", _release_be_keeping_lost, "recompute",
                  "blocks with an owner, fill or overwritten slot"),
    "checkpoint skipped": (BidirectionalBlocks, "_checkpoint", _checkpoint_one_slot_unwritten,
                           "recompute", "a checkpoint does not hold its KV"),
    "cancel dropped": (Scheduler, "_abort", _abort_ignoring_displaced, "recompute",
                       "was cancelled while live but ended length"),
    "wrong reason": (Scheduler, "_abort", _abort_ending_swapped_as_length, "bros",
                     "was cancelled while live but ended length"),
    "kept live": (Scheduler, "_finish", _finish_keeping_swapped_live, "bros",
                  ("the engine never went idle", "ended 2 times")),  # hung, or ran on
    "tickets kept": (SwapPool, "_report", _report_keeping_tickets, "bros",
                     "swap pool tickets pending"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_leak_is_reported(monkeypatch, plant):
    cls, name, replacement, policy, message = PLANTS[plant]
    monkeypatch.setattr(cls, name, replacement)
    found = []
    for seed in range(8):
        for blocks in (10, 24):
            found = problems(run(seed, policy, blocks=blocks))
            if found:
                break
        if found:
            break
    messages = message if isinstance(message, tuple) else (message,)
    assert any(m in p for p in found for m in messages), found
