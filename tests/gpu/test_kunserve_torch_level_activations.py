"""A group stage whose step failed (an error, not a loss) levels the activations with the next
member (gpu/group_stage.py `GroupStage._level_activations`: zeros for those it still owed);
when sending them fails (the sending thread found the next member gone) that is the next
member's loss, `GroupMemberLost` naming it, as in a step that ran (`_run`), so the head
recovers at once instead of reading answers for gloo's 60 s. A stand-in stage and transfer
queue, no processes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.messages import ExecuteStep, SeqWork
from gpu.data_plane import GroupMemberLost
from gpu.group_messages import GroupStep
from gpu.group_stage import GroupStage


class _Queue:
    """A transfer queue whose sending thread failed: `fail` is 'put' (the next queueing raises
    what it died of) or 'flush' (queueing works, the flush raises it)."""

    def __init__(self, fail: str) -> None:
        self.fail, self.sent = fail, []

    def put_activation(self, x: torch.Tensor, *, dst: int, tag: int) -> None:
        if self.fail == "put":
            raise RuntimeError("the sending thread failed: Connection reset by peer")
        self.sent.append((tuple(x.shape), dst))

    def flush(self, kind=None) -> None:
        raise RuntimeError("the sending thread failed: Connection reset by peer")


def _stage(me: int, fail: str) -> GroupStage:
    stage = GroupStage.__new__(GroupStage)  # (no channel, no model: only what the path reads)
    arena = SimpleNamespace(dtype=torch.float32, device=torch.device("cpu"))
    stage.model = SimpleNamespace(first_stage=me == 0, last_stage=False, arena=arena)
    stage.start, stage.me, stage._hidden = SimpleNamespace(ranks=(5, 7, 9)), me, 8
    stage.plane = SimpleNamespace(rank=(5, 7, 9)[me], queue=_Queue(fail))

    def run(msg):  # the step fails here after its microbatch came in, before it went out
        stage._micro_io = [1, 0]
        raise ValueError("the step failed here")

    stage._run = run
    return stage


@pytest.mark.parametrize("me", [0, 1])
@pytest.mark.parametrize("fail", ["put", "flush"])
def test_a_failed_step_whose_zeros_cannot_be_sent_is_the_next_members_loss(me, fail):
    stage = _stage(me, fail)
    step = ExecuteStep(step_id=3, release=(), setups=(), blocks=(),
                       seqs=(SeqWork(request_id=1, start=0, num_tokens=3, sample=True),))
    msg = GroupStep(step=step, fed_back=(), micro=(((0, 0, 3),),))
    with pytest.raises(GroupMemberLost) as info:
        stage.run(msg)
    nxt = (7, 9)[me]
    assert str(info.value).startswith(f"pipeline group member instance {nxt} was lost while "
                                      f"activations were being sent: RuntimeError"), info.value
    assert isinstance(info.value.__cause__.__context__, ValueError), \
        "the step's own error was not kept"
    if fail == "flush":  # (the zeros went into the queue: one microbatch, [3 tokens, hidden])
        assert stage.plane.queue.sent == [((3, 8), nxt)]
