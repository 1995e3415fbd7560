"""Found by tests/sim/test_chaos_kunserve_sim.py: a cancel that reaches a group head's frontend
after it took over a moved request's stream (KunServe: `TakeOverStreams`) but before the head's
scheduler adopted the request was lost; the request ran on to its end for nobody (190-200
tokens in the chaos runs) because a gone stream is never written to, so nothing noticed."""

from __future__ import annotations

import pytest
import trio

from engine.messages import AbortRequest, Cancel, HandOverStreams, TakeOverStreams, TokenOutput
from engine.reply import Reply
from tests.actors.inbox import nothing_waiting, receive
from tests.actors.test_frontend import admitted, outputs, start_frontend

pytestmark = pytest.mark.trio


async def _ask(front, make):
    reply = Reply()
    await front.inbox.send(make(reply))
    return await reply.wait()


async def test_a_cancel_before_the_head_adopts_a_moved_request_is_sent_again(nursery,
                                                                             autojump_clock):
    member, head = await start_frontend(nursery), await start_frontend(nursery)
    old, _ = await admitted(member, "q")
    streams = await _ask(member, lambda r: HandOverStreams(request_ids=(old,), reply=r))
    new = (await _ask(head, lambda r: TakeOverStreams(streams=streams, reply=r)))[old]
    await head.inbox.send(Cancel(request_id=new))  # its scheduler does not know `new` yet
    assert await receive(head.scheduler) == AbortRequest(request_id=new, reason="cancelled")
    # the head's scheduler adopts it and, not knowing of the abort, runs a step: the first
    # output of a gone stream moved here aborts it again, now that the scheduler has it
    await outputs(head, TokenOutput(request_id=new, token_ids=(5,)))
    assert await receive(head.scheduler) == AbortRequest(request_id=new, reason="cancelled")
    await outputs(head, TokenOutput(request_id=new, token_ids=(6,)))  # the step in flight
    await trio.sleep(1)
    assert nothing_waiting(head.scheduler) and nothing_waiting(member.scheduler)


async def test_a_moved_request_delivered_to_is_aborted_once(nursery, autojump_clock):
    """Once an output reached the moved stream the head's scheduler has the request, and a
    later cancel is sent once, as for any request."""
    member, head = await start_frontend(nursery), await start_frontend(nursery)
    old, _ = await admitted(member, "q")
    streams = await _ask(member, lambda r: HandOverStreams(request_ids=(old,), reply=r))
    new = (await _ask(head, lambda r: TakeOverStreams(streams=streams, reply=r)))[old]
    await outputs(head, TokenOutput(request_id=new, token_ids=(5,)))
    await head.inbox.send(Cancel(request_id=new))
    assert await receive(head.scheduler) == AbortRequest(request_id=new, reason="cancelled")
    await outputs(head, TokenOutput(request_id=new, token_ids=(6,)))
    await trio.sleep(1)
    assert nothing_waiting(head.scheduler)
