"""The front door's handle on an instance process, over a stand-in link: a request handed back
when its instance dies carries whether its client was already told `Admitted`, so the next
instance's `Admitted` reaches a client still waiting for one (before: every hand-back counted as
announced, the client took the new instance's first chunk for its admission answer and lost
that token), and a refusal after admission reaches the client as a last chunk. A handed-back
request keeps when the front door first took it, and its timeline counts from there (before:
its TTFT left out the time it spent at the dead instance)."""

from __future__ import annotations

import math

import anyio
import pytest

import shunter
from engine.errors import QueueFullError
from engine.messages import Submit
from engine.outputs import Admitted, GenerationChunk, Rejected
from engine.timeline import RequestTimeline
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


async def _die_after(outputs: list[object], since: float | None = None) -> list[tuple]:
    """Submit request 7, let the instance send `outputs`, kill it; what was handed back."""
    link, handed_back = _Link(), []

    async def redispatch(key: int, submit: Submit, announced: bool, since: float) -> None:
        handed_back.append((key, announced, since))

    async def on_down(index: int, reason: str) -> None:
        pass

    handle = RemoteInstance(2, link, on_end=lambda key: None, redispatch=redispatch,
                            on_down=on_down, describe_death=lambda: "instance 2 was killed",
                            kill=lambda: None)
    submit, _ = _submit()
    async with anyio.create_task_group() as tg:
        await tg.start(handle.run)
        await handle.submit(7, submit, since=since)
        assert isinstance(link.sent[0], SubmitRequest)
        for out in outputs:
            await link.peer_send.send(Output(key=7, output=out))
        link.peer_send.close()
    return handed_back


def _living_handle(link: _Link) -> RemoteInstance:
    """A handle on an instance that does not die in the test: nothing is handed back."""

    async def never(*args) -> None:
        raise AssertionError("nothing is handed back here")

    return RemoteInstance(1, link, on_end=lambda key: None, redispatch=never, on_down=never,
                          describe_death=lambda: "", kill=lambda: None)


@pytest.mark.anyio
async def test_a_request_its_dead_instance_never_admitted_is_handed_back_unannounced():
    before = anyio.current_time()
    [(key, announced, since)] = await _die_after([])
    assert (key, announced) == (7, False) and before <= since <= anyio.current_time()


@pytest.mark.anyio
async def test_a_request_whose_admission_reached_the_client_is_handed_back_announced():
    # handed back a second time: it keeps when the front door first took it
    assert await _die_after([Admitted(request_id=3)], since=12.5) == [(7, True, 12.5)]


@pytest.mark.anyio
async def test_a_handed_back_request_is_timed_from_when_the_front_door_took_it():
    link = _Link()
    handle = _living_handle(link)
    moved, moved_out = _submit()
    fresh, fresh_out = _submit()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(handle.run)
            await handle.submit(2, moved, announced=True, since=anyio.current_time() - 5.0)
            await handle.submit(3, fresh)
            await link.peer_send.send(Output(key=3, output=Admitted(request_id=9)))
            for key in (2, 3):  # the instance's clock: it got both at 100.0, a token at 100.25
                timeline = RequestTimeline(
                    request_id=9, request_class="default", tenant="default",
                    conversation_id=None, prompt_tokens=3, arrival=100.0, first_scheduled=100.1,
                    token_times=(100.25,), finished_at=100.3, finish_reason="length")
                await link.peer_send.send(Output(key=key, output=GenerationChunk(
                    request_id=9, token_ids=(4,), text="", finish_reason="length",
                    timeline=timeline)))
            assert isinstance(await fresh_out.receive(), Admitted)
            moved_ttft = (await moved_out.receive()).timeline.ttft_s
            fresh_ttft = (await fresh_out.receive()).timeline.ttft_s
            tg.cancel_scope.cancel()
    assert 5.25 <= moved_ttft < 5.25 + 1.0  # its 5 s at the dead instance, and the 0.25 s here
    assert fresh_ttft == pytest.approx(0.25)


@pytest.mark.anyio
async def test_a_refusal_after_admission_reaches_the_client_as_an_error_chunk():
    link = _Link()
    handle = _living_handle(link)
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
