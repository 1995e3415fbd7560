"""A stream closed (`aclose()`) from another task while a task reads it: the reader gets
StreamClosedError, then and on every later read, and the request is cancelled with its blocks
freed; in process, and over HTTP against the real server."""

from __future__ import annotations

import anyio
import pytest

from shunter import Client, Engine, EngineConfig, SamplingParams, StreamClosedError
from tests.fakes import fake_backend
from tests.shunter.server.conftest import serving

pytestmark = pytest.mark.anyio

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


async def _close_while_read(stream) -> list:
    """Read `stream` in one task; once it has given two chunks, close it from this one."""
    got: list = []
    two = anyio.Event()

    async def read() -> None:
        try:
            async for chunk in stream:
                got.append(chunk)
                if len(got) == 2:
                    two.set()
        except StreamClosedError as exc:
            got.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await two.wait()
        await stream.aclose()
    return got


async def test_in_process_the_reader_gets_a_named_error_and_the_blocks_are_freed():
    config = EngineConfig(block_size=4, max_num_seqs=4, max_batched_tokens=16)
    async with Engine.start(config, backend=fake_backend(64, 4, step_delay=0.005)) as engine:
        stream = engine.generate([5, 6, 7], LONG)
        got = await _close_while_read(stream)
        with anyio.fail_after(10):
            snap = await engine.wait_idle()
        with pytest.raises(StreamClosedError):  # and later reads say the same
            await stream.__anext__()
        # a stream that ended normally and is then closed stays ended, not "closed"
        done = engine.generate([5], SamplingParams(max_tokens=2, ignore_eos=True))
        chunks = [c async for c in done]
        await done.aclose()
        with pytest.raises(StopAsyncIteration):
            await done.__anext__()
    assert isinstance(got[-1], StreamClosedError), got[-1]
    assert f"request {stream.request_id} was closed (aclose())" in str(got[-1])
    assert all(c.finish_reason is None for c in got[:-1]) and chunks[-1].finish_reason == "length"
    assert snap.allocator.allocated_blocks == 0


async def test_over_http_the_reader_gets_a_named_error_and_the_server_cancels():
    async with serving(EngineConfig(backend="sim", block_size=16, max_num_seqs=8)) as served:
        reasons: list[str] = []
        served.app.state.on_finished.append(lambda chunk, reason, sched: reasons.append(reason))
        async with Client(served.url) as client:
            stream = client.generate([7] * 50, SamplingParams(max_tokens=5000))
            got = await _close_while_read(stream)
            with anyio.fail_after(10):
                while not reasons:
                    await anyio.sleep(0.01)
                snap = await served.engine.wait_idle()
            with pytest.raises(StreamClosedError):
                await stream.__anext__()
    assert isinstance(got[-1], StreamClosedError), got[-1]
    assert reasons == ["cancelled"] and snap.allocator.allocated_blocks == 0
