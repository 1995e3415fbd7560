"""The front door's handle on an instance process, over a stand-in link: a request handed back
when its instance dies carries whether its client was already told `Admitted`, so the next
instance's `Admitted` reaches a client still waiting for one (before: every hand-back counted as
announced, the client took the new instance's first chunk for its admission answer and lost
that token), and a refusal after admission reaches the client as a last chunk."""

from __future__ import annotations

import math

import anyio
import pytest

import shunter
from engine.errors import QueueFullError
from engine.messages import Submit
from engine.outputs import Admitted, GenerationChunk, Rejected
from shunter.cluster.handles import RemoteInstance
from shunter.cluster.wire import Output, SubmitRequest


class _Link:
    """The instance's end is `peer_send` (what the handle receives) and `sent` (what it sent)."""

    def __init__(self) -> None:
        self.peer_send, self._recv = anyio.create_memory_object_stream(math.inf)
        self.sent: list[object] = []

    async def send(self, msg: object) -> None:
        self.sent.append(msg)

    async def receive(self) -> object:
        return await self._recv.receive()  # EndOfStream once the peer closes: the process died

    async def aclose(self) -> None:
        self._recv.close()


def _submit() -> tuple[Submit, anyio.abc.ObjectReceiveStream]:
    send, recv = anyio.create_memory_object_stream(math.inf)
    return Submit(prompt=None, prompt_ids=[1, 2, 3], sampling=shunter.SamplingParams(max_tokens=4),
                  scheduling=shunter.SchedulingParams(), outputs=send, stream=True), recv


async def _die_after(outputs: list[object]) -> list[tuple[int, bool]]:
    """Submit request 7, let the instance send `outputs`, kill it; what was handed back."""
    link, handed_back = _Link(), []

    async def redispatch(key: int, submit: Submit, announced: bool) -> None:
        handed_back.append((key, announced))

    async def on_down(index: int, reason: str) -> None:
        pass

    handle = RemoteInstance(2, link, on_end=lambda key: None, redispatch=redispatch,
                            on_down=on_down, describe_death=lambda: "instance 2 was killed",
                            kill=lambda: None)
    submit, _ = _submit()
    async with anyio.create_task_group() as tg:
        await tg.start(handle.run)
        await handle.submit(7, submit)
        assert isinstance(link.sent[0], SubmitRequest)
        for out in outputs:
            await link.peer_send.send(Output(key=7, output=out))
        link.peer_send.close()
    return handed_back


@pytest.mark.anyio
async def test_a_request_its_dead_instance_never_admitted_is_handed_back_unannounced():
    assert await _die_after([]) == [(7, False)]


@pytest.mark.anyio
async def test_a_request_whose_admission_reached_the_client_is_handed_back_announced():
    assert await _die_after([Admitted(request_id=3)]) == [(7, True)]


@pytest.mark.anyio
async def test_a_refusal_after_admission_reaches_the_client_as_an_error_chunk():
    link = _Link()

    async def never(*args) -> None:
        raise AssertionError("nothing is handed back here")

    handle = RemoteInstance(1, link, on_end=lambda key: None, redispatch=never, on_down=never,
                            describe_death=lambda: "", kill=lambda: None)
    fresh, fresh_out = _submit()
    moved, moved_out = _submit()
    full = Rejected(error=QueueFullError("the waiting queue is full (8 requests)"))
    async with anyio.create_task_group() as tg:
        await tg.start(handle.run)
        await handle.submit(1, fresh)
        await handle.submit(2, moved, announced=True)  # its first instance died after Admitted
        await link.peer_send.send(Output(key=1, output=full))
        await link.peer_send.send(Output(key=2, output=full))
        assert await fresh_out.receive() == full
        last = await moved_out.receive()
        assert isinstance(last, GenerationChunk)
        assert (last.request_id, last.finish_reason) == (2, "error")
        assert last.error == "the waiting queue is full (8 requests)"
        assert handle.live_requests == 0
        tg.cancel_scope.cancel()
