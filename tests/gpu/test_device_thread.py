"""The runner's device thread: one OS thread for every torch call, awaited without blocking."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from gpu.device_thread import DeviceThread, call_on_own_thread
from shunter import Engine, EngineConfig, SamplingParams


@pytest.fixture(params=["token", "worker-thread wait"])
def wake_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways `run` learns that a call finished: a loop token (anyio >= 4.11), or waiting on
    one of anyio's worker threads (older anyio)."""
    if request.param != "token":
        import gpu.device_thread

        monkeypatch.setattr(gpu.device_thread, "current_token", None)
    return request.param


@pytest.mark.anyio
async def test_calls_run_one_at_a_time_on_one_thread_that_is_not_the_loops(
        wake_by: str) -> None:
    thread = DeviceThread()
    active, most, ids = [0], [0], set()

    def work() -> None:
        active[0] += 1
        most[0] = max(most[0], active[0])
        ids.add(threading.get_ident())
        time.sleep(0.005)
        active[0] -= 1

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(thread.run, work)
    finally:
        thread.close()
    assert most[0] == 1
    assert len(ids) == 1 and threading.get_ident() not in ids


@pytest.mark.anyio
async def test_errors_reach_the_caller_and_the_thread_serves_on(wake_by: str) -> None:
    thread = DeviceThread()

    def fail() -> None:
        raise ValueError("step went wrong")

    try:
        with pytest.raises(ValueError, match="step went wrong"):
            await thread.run(fail)
        assert await thread.run(lambda: 41 + 1) == 42
    finally:
        thread.close()


@pytest.mark.anyio
async def test_a_cancelled_caller_still_waits_for_its_call_to_finish(wake_by: str) -> None:
    thread = DeviceThread()
    finished = threading.Event()

    def slow() -> None:
        time.sleep(0.2)
        finished.set()

    try:
        with anyio.move_on_after(0.02) as scope:
            await thread.run(slow)
            # the deadline passed during the call, but the caller came back only after it ended
            assert scope.cancel_called and finished.is_set()
            await anyio.sleep(1)  # and the cancellation is delivered at its next checkpoint
        assert scope.cancelled_caught
    finally:
        thread.close()


def test_close_ends_the_thread_and_a_later_call_makes_a_new_one() -> None:
    thread = DeviceThread()
    first = thread.call(threading.get_ident)
    thread.close()
    assert first not in {t.ident for t in threading.enumerate()}
    second = thread.call(threading.get_ident)
    thread.close()
    assert second != threading.get_ident()
    assert call_on_own_thread(threading.get_ident) != threading.get_ident()


@pytest.mark.anyio
async def test_engine_runs_load_swap_space_and_every_step_on_the_device_thread(
        tiny_llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu.swap import TorchSwapper
    from shunter.backends import build_backend

    config = EngineConfig(model=tiny_llama_dir, num_blocks=64, cpu_swap_blocks=16)
    backend = build_backend(config)
    runner = backend.runner
    seen: set[int] = set()
    load, execute = runner._load, runner.execute

    def on_thread(fn):
        def wrapped(*args, **kwargs):
            seen.add(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapped

    runner._load, runner.execute = on_thread(load), on_thread(execute)
    monkeypatch.setattr(TorchSwapper, "__init__", on_thread(TorchSwapper.__init__))
    async with Engine.start(config, backend=backend) as engine:
        assert engine.swapper is not None
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(engine.complete, [3 + i] * 9, SamplingParams(max_tokens=5))
    assert len(seen) == 1 and threading.get_ident() not in seen
    assert runner._thread._pool is None  # the engine closed it on the way out
