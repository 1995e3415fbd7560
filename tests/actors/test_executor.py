"""The executor actor alone: steps pushed into its inbox, what the scheduler hears back. The
runner is the fake model of tests/fakes.py, which reads its context back through the KV blocks."""

from __future__ import annotations

import anyio
import attrs
import pytest
import trio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.executor import Executor, StepRunner
from engine.messages import (
    BlockUpdate,
    ExecuteStep,
    ExecutorMessage,
    RequestSetup,
    SampledToken,
    SchedulerMessage,
    SeqWork,
    StepFailed,
    StepFinished,
)
from shunter import SamplingParams
from tests.actors.inbox import receive
from tests.fakes import KVCheckingRunner, StepFailingRunner, next_token

pytestmark = pytest.mark.trio

PROMPT = (5, 6, 7, 8, 9)


@attrs.define
class Wired:
    inbox: MemoryObjectSendStream[ExecutorMessage]
    scheduler: MemoryObjectReceiveStream[SchedulerMessage]


async def start_executor(nursery: trio.Nursery, runner: StepRunner) -> Wired:
    inbox_send, inbox = anyio.create_memory_object_stream[ExecutorMessage](4)
    scheduler, scheduler_recv = anyio.create_memory_object_stream[SchedulerMessage](4)
    await nursery.start(Executor(runner=runner, inbox=inbox, scheduler=scheduler).run)
    return Wired(inbox=inbox_send, scheduler=scheduler_recv)


def prefill(step_id: int, request_id: int = 1) -> ExecuteStep:
    """The whole prompt of a new request, in blocks 2 and 3 (block size 4)."""
    return ExecuteStep(
        step_id=step_id, release=(),
        setups=(RequestSetup(request_id=request_id, prompt_ids=PROMPT,
                             sampling=SamplingParams(), eos_token_ids=()),),
        blocks=(BlockUpdate(request_id=request_id, reset=False, append=(2, 3)),),
        seqs=(SeqWork(request_id=request_id, start=0, num_tokens=len(PROMPT), sample=True),))


def decode(step_id: int, start: int, request_id: int = 1) -> ExecuteStep:
    return ExecuteStep(step_id=step_id, release=(), setups=(), blocks=(),
                       seqs=(SeqWork(request_id=request_id, start=start, num_tokens=1, sample=True),))


async def test_a_step_is_run_and_its_samples_reported(nursery, autojump_clock):
    ex = await start_executor(nursery, KVCheckingRunner(num_blocks=8, block_size=4))
    await ex.inbox.send(prefill(step_id=1))
    first = next_token(PROMPT)
    assert await receive(ex.scheduler) == StepFinished(
        step_id=1, sampled=(SampledToken(request_id=1, token_id=first),), compute_s=0.0)
    await ex.inbox.send(decode(step_id=2, start=len(PROMPT)))
    done = await receive(ex.scheduler)
    assert done.step_id == 2
    assert done.sampled == (SampledToken(request_id=1, token_id=next_token((*PROMPT, first))),)


async def test_steps_are_answered_in_order_and_take_the_runners_time(nursery, autojump_clock):
    runner = KVCheckingRunner(num_blocks=8, block_size=4, step_delay=0.25)
    ex = await start_executor(nursery, runner)
    began = trio.current_time()
    await ex.inbox.send(prefill(step_id=1, request_id=1))
    await ex.inbox.send(prefill(step_id=2, request_id=2))
    assert [(await receive(ex.scheduler)).step_id for _ in range(2)] == [1, 2]
    assert trio.current_time() - began == pytest.approx(0.5)
    assert runner.steps == 2


async def test_a_step_that_raises_is_reported_failed_naming_the_error(nursery, autojump_clock):
    runner = StepFailingRunner(8, 4, fail_steps={2}, error=ValueError("block 9 is out of range"))
    ex = await start_executor(nursery, runner)
    await ex.inbox.send(prefill(step_id=1))
    await ex.inbox.send(decode(step_id=2, start=len(PROMPT)))
    await ex.inbox.send(decode(step_id=3, start=len(PROMPT)))
    assert isinstance(await receive(ex.scheduler), StepFinished)
    assert await receive(ex.scheduler) == StepFailed(
        step_id=2, error="ValueError: block 9 is out of range")
    # the executor goes on with the next step
    after = await receive(ex.scheduler)
    assert isinstance(after, StepFinished) and after.step_id == 3


async def test_the_executor_returns_when_its_inbox_closes(autojump_clock):
    inbox_send, inbox = anyio.create_memory_object_stream[ExecutorMessage](4)
    scheduler, scheduler_recv = anyio.create_memory_object_stream[SchedulerMessage](4)
    executor = Executor(runner=KVCheckingRunner(num_blocks=8, block_size=4), inbox=inbox,
                        scheduler=scheduler)
    await inbox_send.send(prefill(step_id=1))
    inbox_send.close()
    with trio.fail_after(1):
        await executor.run()
    assert (await receive(scheduler_recv)).step_id == 1
