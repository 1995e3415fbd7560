"""A grouped step that fails (an error, not a loss), around the head (gpu/group_runner.py).

KV arrivals reported with a failed grouped step are not lost (the reviewer's s32 item 1). A
member's answer carries the requests whose exchanged KV arrived there since its last answer,
taken off its receiver; the head notes each answer's arrivals as it reads it
(gpu/group_runner.py `_answers`) and its own as its stage answers, before judging any, and a
member whose step failed still sends its arrivals with its error (gpu/group_stage.py
`failed_reply`). Before, a failed step dropped them: those requests never became `arrived()`,
the engine kept them waiting for their KV for ever, and `_settled` refused every restore.

The answers to a failed step also carry the member's restore prefetch flags (`prefetched`,
`kv_void`, `weights_from_host`; review-2 s32), and the head notes them as it notes the
arrivals: before, they waited for a step that succeeded.

A step whose cut fails names no KV round of a restore prefetch (review s32 item 4): before, the
round was named (its receives posted) and no member got the step. Stand-in stages and channel,
no processes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import gpu.group_runner as gr
from engine.messages import ExecuteStep, SeqWork
from gpu.data_plane import GroupMemberLost
from gpu.group_messages import GroupStep, MemberReply
from gpu.group_runner import GroupRunner
from gpu.group_stage import GroupStage

STEP = ExecuteStep(step_id=3, release=(), setups=(), blocks=(),
                   seqs=(SeqWork(request_id=1, start=0, num_tokens=2, sample=True),))
MSG = GroupStep(step=STEP, fed_back=(), micro=(((0, 0, 2),),))


class _Receiver:
    def __init__(self, arrived) -> None:
        self.arrived = list(arrived)

    def take_arrived(self) -> list[int]:
        out, self.arrived = self.arrived, []
        return out


def _runner(monkeypatch, head, replies) -> GroupRunner:
    """A head of members 1 and 2 (ranks 5 and 6): requests 7, 8, 9 wait for their KV on
    member 1, member 2 and the head; `head` runs its stage's step, `replies` answer it."""
    runner = GroupRunner.__new__(GroupRunner)
    runner.ranks, runner._unanswered, runner._fed_back = (4, 5, 6), [], ()
    runner._expect, runner._ready = {7: {1}, 8: {2}, 9: {0}}, []
    runner.stage = SimpleNamespace(run=head, kv_prefetch=None, receiver=_Receiver(()))
    monkeypatch.setattr(gr, "send_obj", lambda *args: None)
    monkeypatch.setattr(gr, "recv_obj", lambda rank, tag, what: replies[rank])
    return runner


@pytest.mark.parametrize("fails", ["a member", "the head"])
def test_arrivals_answered_with_a_failed_step_are_noted(monkeypatch, fails):
    def head(msg):
        if fails == "the head":
            raise ValueError("the head's step failed here")
        return MemberReply(step_id=3, arrived=(9,))

    error = "RuntimeError: boom" if fails == "a member" else None
    runner = _runner(monkeypatch, head, {5: MemberReply(step_id=3, error=error, arrived=(7,)),
                                         6: MemberReply(step_id=3, arrived=(8,))})
    with pytest.raises((RuntimeError, ValueError), match="boom|the head's step failed"):
        runner._run(STEP, MSG, 0.0)
    want = [7, 8, 9] if fails == "a member" else [7, 8]  # (the head's own: still in its
    assert sorted(runner.arrived()) == want, "arrivals lost with the failed step"  # receiver)
    assert runner.exchanging() == ({9} if fails == "the head" else set())


def test_a_member_whose_step_fails_after_it_ran_answers_its_arrivals():
    """The KV round fails once the step ran (its reply built): the arrivals go with the error."""
    stage = GroupStage.__new__(GroupStage)
    stage.receiver, stage.me = _Receiver([7]), 1

    def run(msg):
        stage._micro_io = [1, 1]  # (its activations all went: nothing to level)
        return MemberReply(step_id=3)

    def kv_round(spans, placeholder):
        if not placeholder:
            raise OSError("the round could not be gathered")

    stage._run, stage._kv_round = run, kv_round
    stage._level_activations = lambda msg: None
    with pytest.raises(OSError) as info:
        stage.run(MSG)
    reply = stage.failed_reply(3, info.value)
    assert reply.arrived == (7,) and reply.error == "OSError: the round could not be gathered"


def test_a_step_whose_cut_fails_names_no_kv_round(monkeypatch):
    """The head names a step's KV round (posting its receives) only once the step's cut is
    made and checked (review s32 item 4): a cut that fails sends no member the step, so none
    would send that round, and every later round would be read one round behind."""
    named = []
    kv = SimpleNamespace(step_spans=lambda step: {1: (0, 1)}, add=named.append)

    def cut(*args, **kwargs):
        raise ValueError("no cut for this step")

    runner = _runner(monkeypatch, None, {})
    runner.stage.kv_prefetch, runner._computed, runner.set_up = kv, {}, set()
    runner.fits, runner.microbatches, runner.microbatch = SimpleNamespace(cut=cut), 2, "tokens"
    with pytest.raises(ValueError, match="no cut"):
        runner.execute(STEP)
    assert named == [], "a round was named for a step no member got"


def test_a_failed_steps_answer_carries_the_members_prefetch_flags():
    """A member whose step failed still says that its prefetched weights are in, that its KV
    rounds are zeros (`kv_void`) and that its weights come from its host copy; one whose
    prefetch ended in a loss answers that loss."""
    stage = GroupStage.__new__(GroupStage)
    stage.receiver = _Receiver([7])
    stage.kv_void = "the first KV round could not be gathered"
    stage.prefetch = SimpleNamespace(check=lambda: True, from_host="it could not vacate")
    reply = stage.failed_reply(3, RuntimeError("boom"))
    assert (reply.error, reply.arrived, reply.prefetched, reply.kv_void,
            reply.weights_from_host) == ("RuntimeError: boom", (7,), True, stage.kv_void,
                                         "it could not vacate"), reply
    stage.prefetch_failed = GroupMemberLost(6, "its KV round was sent", OSError("gone"))
    lost = stage.failed_reply(4, RuntimeError("boom"))
    assert lost.lost == 6 and "instance 6 was lost" in lost.error, lost


@pytest.mark.parametrize("fails", ["a member", "the head"])
def test_the_head_notes_the_prefetch_flags_of_a_failed_steps_answers(monkeypatch, fails):
    """The head hears member 1's fallback (its KV rounds void: none is used) and member 2's
    weights in from the answers to a step that failed, its own or a member's."""
    def head(msg):
        if fails == "the head":
            raise ValueError("the head's step failed here")
        return MemberReply(step_id=3)

    abandoned = []
    runner = _runner(monkeypatch, head, {
        5: MemberReply(step_id=3, error="RuntimeError: boom" if fails == "a member" else None,
                       prefetched=False, kv_void="gather failed"),
        6: MemberReply(step_id=3, prefetched=True)})
    runner.stage.kv_prefetch = SimpleNamespace(abandon=abandoned.append, void=lambda spans: None)
    runner._prefetched, runner.prefetch_heard, runner.prefetch_fallbacks = set(), set(), {}
    with pytest.raises((RuntimeError, ValueError), match="boom|the head's step failed"):
        runner._run(STEP, MSG, 0.0)
    assert abandoned == ["instance 5: gather failed"], "a failed step's kv_void was dropped"
    assert runner.prefetch_heard == {5, 6} and runner._prefetched == {6}, runner.prefetch_heard
    assert runner.prefetch_fallbacks == {"5 kv": "gather failed"}
