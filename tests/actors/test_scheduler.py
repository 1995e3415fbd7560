"""The scheduler actor alone: messages pushed into its inbox, the `RunStep`s it sends the
allocator and the `StepOutputs` it sends the frontend, on trio's virtual clock. The test plays
the executor (and the swap pool) by answering each step by hand."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import attrs
import pytest
import trio
import trio.testing
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.scheduler import Scheduler
from engine.messages import (
    AbortRequest,
    AddRequest,
    AllocatorMessage,
    FrontendMessage,
    InspectScheduler,
    RequestSetup,
    RunStep,
    SampledToken,
    SchedulerMessage,
    SeqWork,
    StepFailed,
    StepFinished,
    StepOutputs,
    SwapDone,
    SwapIn,
    TakeIterationLog,
    TokenOutput,
)
from engine.policy import (
    ClassSpec,
    Decision,
    IterationOutcome,
    MemorySettings,
    PolicySettings,
    SchedulerView,
)
from engine.reply import Reply
from engine.snapshots import SchedulerSnapshot
from shunter import EngineConfig, SamplingParams, SchedulingParams
from tests.actors.inbox import nothing_waiting, receive

pytestmark = pytest.mark.trio

BS = 4


@attrs.define
class OldestFirst:
    """FCFS with the settings a test asks for; remembers what it was told after each step."""

    settings: PolicySettings
    source: str = ""
    outcomes: list[IterationOutcome] = attrs.field(factory=list)

    def decide(self, view: SchedulerView) -> Decision:
        return Decision(order=sorted(view.requests, key=lambda r: (r.arrival, r.id)))

    def observe(self, outcome: IterationOutcome) -> None:
        self.outcomes.append(outcome)


@attrs.define
class Wired:
    policy: OldestFirst
    inbox: MemoryObjectSendStream[SchedulerMessage]
    allocator: MemoryObjectReceiveStream[AllocatorMessage]
    frontend: MemoryObjectReceiveStream[FrontendMessage]

    async def step(self) -> RunStep:
        msg = await receive(self.allocator)
        assert isinstance(msg, RunStep)
        return msg

    async def outputs(self) -> tuple[TokenOutput, ...]:
        msg = await receive(self.frontend)
        assert isinstance(msg, StepOutputs)
        return msg.outputs

    async def finish(self, step: RunStep, *tokens: tuple[int, int], stall_s: float = 0.0) -> None:
        await self.inbox.send(StepFinished(
            step_id=step.step_id, compute_s=0.0, stall_s=stall_s,
            sampled=tuple(SampledToken(request_id=r, token_id=t) for r, t in tokens)))

    async def inspect(self) -> SchedulerSnapshot:
        reply = Reply[SchedulerSnapshot]()
        await self.inbox.send(InspectScheduler(reply=reply))
        return await reply.wait()


def _make_policy(**settings: object) -> OldestFirst:
    return OldestFirst(settings=PolicySettings(name="oldest-first", **settings))  # type: ignore[arg-type]


def _make_swap_policy(swap_in: str = "sync") -> OldestFirst:
    return _make_policy(preempt_mode="swap",
                        memory=MemorySettings(swap_granularity="groups", swap_in=swap_in))


def _make_add(request_id: int, prompt: Sequence[int] = (5, 6, 7), *, max_tokens: int = 4,
              arrival: float = 0.0, **scheduling: object) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_ids=tuple(prompt),
                      sampling=SamplingParams(max_tokens=max_tokens),
                      scheduling=SchedulingParams(**scheduling),  # type: ignore[arg-type]
                      arrival=arrival + request_id * 1e-3, eos_token_ids=(3,))


async def _start(nursery: trio.Nursery, *first: SchedulerMessage, policy: OldestFirst | None = None,
                 num_blocks: int = 16, cpu_blocks: int = 0, **config: object) -> Wired:
    """A scheduler with `first` already in its inbox (so it plans them in one iteration)."""
    policy = policy or _make_policy()
    inbox_send, inbox = anyio.create_memory_object_stream[SchedulerMessage](16)
    allocator_send, allocator = anyio.create_memory_object_stream[AllocatorMessage](16)
    frontend_send, frontend = anyio.create_memory_object_stream[FrontendMessage](16)
    for msg in first:
        inbox_send.send_nowait(msg)
    scheduler = Scheduler(
        config=EngineConfig(block_size=BS, max_num_seqs=8, max_batched_tokens=64, **config),  # type: ignore[arg-type]
        policy=policy, num_blocks=num_blocks, max_context=4096, inbox=inbox,
        allocator=allocator_send, frontend=frontend_send, cpu_blocks=cpu_blocks)
    await nursery.start(scheduler.run)
    return Wired(policy=policy, inbox=inbox_send, allocator=allocator, frontend=frontend)


async def test_a_request_runs_from_its_prompt_to_a_length_finish(nursery, autojump_clock):
    s = await _start(nursery, _make_add(1, max_tokens=2))
    first = await s.step()
    assert first.setups == (RequestSetup(request_id=1, prompt_ids=(5, 6, 7),
                                         sampling=SamplingParams(max_tokens=2),
                                         eos_token_ids=(3,)),)
    assert first.seqs == (SeqWork(request_id=1, start=0, num_tokens=3, sample=True),)
    assert (first.block_targets, first.release, first.preempt) == (((1, 1),), (), ())
    await s.finish(first, (1, 42))
    assert await s.outputs() == (TokenOutput(request_id=1, token_ids=(42,)),)
    second = await s.step()
    assert (second.setups, second.block_targets) == ((), ((1, 1),))
    assert second.seqs == (SeqWork(request_id=1, start=3, num_tokens=1, sample=True),)
    await s.finish(second, (1, 43))
    token, end = await s.outputs()
    assert token == TokenOutput(request_id=1, token_ids=(43,))
    assert (end.request_id, end.token_ids, end.finish_reason) == (1, (), "length")
    assert end.metrics.finish_reason == "length" and len(end.metrics.token_times) == 2
    release = await s.step()           # the next step only gives the request's blocks back
    assert (release.release, release.seqs, release.block_targets) == ((1,), (), ())
    [served] = s.policy.outcomes[-1].served          # the request as the policy saw it
    assert (served[0].id, served[0].output_tokens, served[1:]) == (1, 1, (0, 1))


async def test_an_abort_while_in_flight_ends_the_request_when_its_step_returns(
        nursery, autojump_clock):
    s = await _start(nursery, _make_add(1))
    step = await s.step()
    await s.inbox.send(AbortRequest(request_id=1, reason="cancelled"))
    await trio.testing.wait_all_tasks_blocked()
    assert nothing_waiting(s.frontend)               # not yet: its step is still running
    await s.finish(step, (1, 42))
    [end] = await s.outputs()                        # the token sampled meanwhile is dropped
    assert (end.request_id, end.token_ids, end.finish_reason) == (1, (), "cancelled")
    assert (await s.step()).release == (1,)


async def test_an_abort_of_a_waiting_request_ends_it_at_once(nursery, autojump_clock):
    s = await _start(nursery, _make_add(1), _make_add(2, prompt=range(40)), num_blocks=10)
    step = await s.step()                            # 2 waits: 10 more blocks do not fit
    assert [w.request_id for w in step.seqs] == [1]
    await s.inbox.send(AbortRequest(request_id=2, reason="cancelled"))
    [end] = await s.outputs()
    assert (end.request_id, end.finish_reason) == (2, "cancelled")
    await s.finish(step, (1, 42))
    await s.outputs()
    assert (await s.step()).release == ()            # it never reached the executor


async def test_a_pool_too_small_swaps_the_least_deserving_request_out(nursery, autojump_clock):
    s = await _start(nursery, _make_add(1, prompt=(5, 6, 7, 8)), _make_add(2, prompt=(9, 8, 7, 6)),
                     policy=_make_swap_policy(), num_blocks=2, cpu_blocks=8)
    first = await s.step()
    assert first.block_targets == ((1, 1), (2, 1))
    await s.finish(first, (1, 10), (2, 20))
    await s.outputs()
    # each now needs a second block for its fifth token: the later arrival makes room
    second = await s.step()
    assert second.preempt == (2,)
    [out] = second.swap_out
    assert (out.request_id, out.first_block, len(out.cpu_blocks)) == (2, 0, 1)
    assert second.seqs == (SeqWork(request_id=1, start=4, num_tokens=1, sample=True),)
    assert second.block_targets == ((1, 2),)
    snapshot = await s.inspect()
    assert (snapshot.running, snapshot.swapped, snapshot.free_blocks) == (1, 1, 0)
    assert (snapshot.preemptions, snapshot.cpu_copies) == (1, 1)
    await s.finish(second, (1, 11))
    await s.outputs()
    third = await s.step()                           # nothing frees a block: 2 stays out
    assert third.swap_in == () and [w.request_id for w in third.seqs] == [1]


async def test_a_cancel_while_swapped_out_ends_it_and_frees_its_host_copy(
        nursery, autojump_clock):
    s = await _start(nursery, _make_add(1, prompt=(5, 6, 7, 8)), _make_add(2, prompt=(9, 8, 7, 6)),
                     policy=_make_swap_policy(), num_blocks=2, cpu_blocks=8)
    first = await s.step()
    await s.finish(first, (1, 10), (2, 20))
    await s.outputs()
    second = await s.step()
    assert second.preempt == (2,)                    # 2 is on the host now
    await s.inbox.send(AbortRequest(request_id=2, reason="cancelled"))
    [end] = await s.outputs()                        # at once: no step of its is running
    assert (end.request_id, end.finish_reason) == (2, "cancelled")
    snapshot = await s.inspect()
    assert (snapshot.swapped, snapshot.cpu_copies, snapshot.cpu_free_blocks) == (0, 0, 8)
    assert snapshot.cancelled_by_state == (("swapped", 1),)
    await s.finish(second, (1, 11))
    await s.outputs()
    assert (await s.step()).swap_in == ()            # nothing comes back for it


async def test_a_swapped_request_comes_back_synchronously_into_its_step(nursery, autojump_clock):
    s = await _start(nursery, _make_add(1, prompt=(5, 6, 7, 8), max_tokens=2),
                     _make_add(2, prompt=(9, 8, 7, 6)), policy=_make_swap_policy(),
                     num_blocks=2, cpu_blocks=8)
    await s.finish(await s.step(), (1, 10), (2, 20))
    await s.outputs()
    second = await s.step()
    [out] = second.swap_out
    await s.finish(second, (1, 11))                  # 1 ends (length): its blocks come back
    await s.outputs()
    third = await s.step()
    assert third.release == (1,)
    assert third.swap_in == (SwapIn(request_id=2, cpu_blocks=out.cpu_blocks, sync=True),)
    assert third.seqs == (SeqWork(request_id=2, start=4, num_tokens=1, sample=True),)
    assert third.block_targets == ((2, 2),) and third.setups == ()


async def test_an_asynchronous_swap_in_joins_the_batch_once_the_pool_reports_it(
        nursery, autojump_clock):
    s = await _start(nursery, _make_add(1, prompt=(5, 6, 7, 8), max_tokens=2),
                     _make_add(2, prompt=(9, 8, 7, 6)), policy=_make_swap_policy("async"),
                     num_blocks=2, cpu_blocks=8)
    await s.finish(await s.step(), (1, 10), (2, 20))
    await s.outputs()
    await s.finish(await s.step(), (1, 11))
    await s.outputs()
    third = await s.step()
    [swap_in] = third.swap_in
    assert (swap_in.request_id, swap_in.sync, third.seqs) == (2, False, ())
    assert third.block_targets == ((2, 1),)
    assert (await s.inspect()).swapping_in == 1
    await s.finish(third)
    await s.inbox.send(SwapDone(request_ids=(2,), seconds_per_block=0.001))
    fourth = await s.step()
    assert fourth.swap_in == ()
    assert fourth.seqs == (SeqWork(request_id=2, start=4, num_tokens=1, sample=True),)


async def test_a_failed_step_ends_every_request_in_it_with_an_error(nursery, autojump_clock):
    s = await _start(nursery, _make_add(1), _make_add(2))
    step = await s.step()
    await s.inbox.send(StepFailed(step_id=step.step_id, error="CUDA out of memory"))
    ends = await s.outputs()
    assert [(e.request_id, e.finish_reason, e.error) for e in ends] == [
        (1, "error", "the model step failed: CUDA out of memory"),
        (2, "error", "the model step failed: CUDA out of memory")]
    assert (await s.step()).release == (1, 2)
    assert (await s.inspect()).live_requests == ()


async def test_inspect_answers_with_the_queues_and_the_blocks_requests_hold(
        nursery, autojump_clock):
    s = await _start(nursery, _make_add(1, prompt=range(6)), _make_add(2, prompt=range(30)),
                     num_blocks=8)
    step = await s.step()                            # 1 takes 2 blocks; 2 needs 8 and waits
    snapshot = await s.inspect()
    assert (snapshot.iteration, snapshot.policy, snapshot.live_requests) == (1, "oldest-first", (1, 2))
    assert (snapshot.waiting, snapshot.running, snapshot.swapped, snapshot.swapping_in) == (1, 1, 0, 0)
    assert (snapshot.free_blocks, snapshot.total_blocks) == (6, 8)
    assert (snapshot.cpu_total_blocks, snapshot.cpu_copies) == (0, 0)
    await s.finish(step, (1, 42))
    await s.outputs()
    await s.step()
    snapshot = await s.inspect()
    assert (snapshot.iteration, snapshot.free_blocks, snapshot.waiting) == (2, 6, 1)


async def test_requests_the_policy_cannot_take_end_with_an_error_at_once(nursery, autojump_clock):
    policy = _make_policy(classes=(ClassSpec(name="rt", max_queued=1),), default_class="rt")
    s = await _start(nursery, policy=policy, num_blocks=4)
    await s.inbox.send(_make_add(1, request_class="batch"))
    [end] = await s.outputs()
    assert (end.finish_reason, end.error) == (
        "error", "unknown request class 'batch' (policy oldest-first declares: rt)")
    for rid in (2, 3):
        await s.inbox.send(_make_add(rid, prompt=range(40)))  # 10 blocks: both stay queued
    [end] = await s.outputs()
    assert (end.request_id, end.error) == (
        3, "class rt already has 1 queued requests (max_queued in policy oldest-first)")


async def test_the_iteration_log_counts_steps_and_preemptions(nursery, autojump_clock):
    s = await _start(nursery, _make_add(1, prompt=(5, 6, 7, 8)), _make_add(2, prompt=(9, 8, 7, 6)),
                     policy=_make_swap_policy(), num_blocks=2, cpu_blocks=8,
                     record_iterations=True)
    await s.finish(await s.step(), (1, 10), (2, 20))
    await s.outputs()
    await s.step()
    reply = Reply()
    await s.inbox.send(TakeIterationLog(reply=reply))
    log = await reply.wait()
    assert (len(log), log.preemptions, list(log.batch_seqs), list(log.used_blocks)) == (
        2, 1, [2, 1], [2, 2])
    assert log.swap.reused_blocks == 0 and log.swap.sync_swap_ins == 0
