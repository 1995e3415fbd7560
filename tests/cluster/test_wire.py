"""The control link's framing survives a sender cancelled mid-message: under trio a socket
send writes in parts, with a checkpoint between them, so a cancelled send could leave half a
frame on the link (the peer then reads the next message's bytes as the rest of this one)."""

from __future__ import annotations

import anyio
import pytest
from anyio.abc import ByteStream

from engine.params import SamplingParams, SchedulingParams
from shunter.cluster.wire import CancelRequest, Link, SubmitRequest

pytestmark = pytest.mark.anyio


class PartialWrites(ByteStream):
    """Writes the first half of each send, then waits for `more` before the rest, as a socket
    whose buffer is full does; the bytes written feed `peer`, a Link reading them."""

    def __init__(self) -> None:
        self.more = anyio.Event()
        self.half_written = anyio.Event()
        self._in, self._out = anyio.create_memory_object_stream[bytes](100)

    async def send(self, item: bytes) -> None:
        half = len(item) // 2
        await self._in.send(item[:half])
        self.half_written.set()
        await self.more.wait()
        await self._in.send(item[half:])

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self._out.receive()

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        self._in.close()


async def test_a_sender_cancelled_mid_message_leaves_the_frame_whole():
    stream = PartialWrites()
    sender, reader = Link(stream), Link(stream)
    submit = SubmitRequest(key=1, prompt=None, prompt_ids=tuple(range(500)),
                           sampling=SamplingParams(max_tokens=4),
                           scheduling=SchedulingParams())
    async with anyio.create_task_group() as tg:
        client = anyio.CancelScope()

        async def send_as_client() -> None:
            with client:  # the client's task: cancelled when its HTTP client hangs up
                await sender.send(submit)

        tg.start_soon(send_as_client)
        await stream.half_written.wait()
        client.cancel()
        stream.more.set()
        with anyio.fail_after(10):
            await sender.send(CancelRequest(key=2))
            assert await reader.receive() == submit
            assert await reader.receive() == CancelRequest(key=2)
