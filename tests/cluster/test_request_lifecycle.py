"""Every request through the cluster's front door ends, and no token is lost, whatever the
interleaving: a real `Cluster`, its real coordinator and instance handles, with stand-in control
links the test answers for the instances (so each interleaving is forced by events, not by
timing), and real clients (`cluster.generate`). The instance process's side
(`InstanceServer`, and the in-process handle) runs over stand-in engines."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from types import SimpleNamespace

import anyio
import pytest

import shunter
from actors.coordinator import Coordinator
from engine.cluster.dispatch import DISPATCH_RULES, NoInstanceError
from engine.cluster.messages import ChooseInstance, InspectCluster
from engine.config import EngineConfig
from engine.errors import EngineDeadError, ShunterError
from engine.outputs import Admitted, GenerationChunk, Rejected
from engine.reply import Reply
from shunter.cluster.cluster import Cluster
from shunter.cluster.handles import RemoteInstance
from shunter.cluster.inprocess import InProcessInstance
from shunter.cluster.instance import InstanceServer
from shunter.cluster.wire import (
    AskSnapshot,
    CancelRequest,
    Detach,
    Hello,
    Output,
    PolicyReplaced,
    ReplacePolicyText,
    Shutdown,
    Snapshot,
    SubmitRequest,
)
from shunter.policy_source import engine_capabilities, initial_policy

pytestmark = pytest.mark.anyio

GUARD_S = 10
"""Only a hang reaches this: every wait below is on an event the test itself causes."""
DIED = EngineDeadError("the executor actor failed: RuntimeError: boom")


class Link:
    """A stand-in control link. The far end (the instance, played by the test) sends with
    `peer_send` (closing it is the process dying) and reads what was sent with `next_sent()`."""

    def __init__(self) -> None:
        self.peer_send, self._recv = anyio.create_memory_object_stream(math.inf)
        self._sent_send, self._sent = anyio.create_memory_object_stream(math.inf)
        self.sent: list[object] = []
        self.broken = False
        """Sends raise, as on a socket whose peer has gone."""
        self.send_failed = anyio.Event()

    async def send(self, msg: object) -> None:
        if self.broken:
            self.send_failed.set()
            raise anyio.BrokenResourceError
        self.sent.append(msg)
        self._sent_send.send_nowait(msg)

    async def next_sent(self) -> object:
        with anyio.fail_after(GUARD_S):
            return await self._sent.receive()

    async def receive(self) -> object:
        return await self._recv.receive()

    async def aclose(self) -> None:
        self._recv.close()

    async def answer(self, key: int, *outputs: object) -> None:
        for out in outputs:
            await self.peer_send.send(Output(key=key, output=out))


@contextlib.asynccontextmanager
async def stand_in_cluster(count: int = 2) -> AsyncIterator[tuple[Cluster, list[Link],
                                                                   list[anyio.Event]]]:
    """A Cluster with its coordinator (round robin) and `count` remote handles over stand-in
    links; the events are set once each handle's reader has ended (after any hand-back)."""
    cluster = Cluster(EngineConfig(backend="sim"), None, count, 1.0, None, None)
    send, recv = anyio.create_memory_object_stream(math.inf)
    cluster._coordinator = send
    links, ended = [Link() for _ in range(count)], [anyio.Event() for _ in range(count)]

    async def run(handle: RemoteInstance, done: anyio.Event, *, task_status) -> None:
        try:
            await handle.run(task_status=task_status)
        finally:
            done.set()

    with anyio.fail_after(GUARD_S):  # a client left waiting for ever fails the test
        async with anyio.create_task_group() as tg:
            await tg.start(cluster._run_coordinator, Coordinator(
                table=cluster.table, rule=DISPATCH_RULES["round_robin"], inbox=recv), recv)
            for i, link in enumerate(links):
                handle = RemoteInstance(i, link, on_end=cluster._ended,
                                        redispatch=cluster._redispatch,
                                        on_down=cluster._instance_down,
                                        describe_death=lambda i=i: f"instance {i} was killed",
                                        kill=lambda: None)
                cluster.instances.append(handle)
                await tg.start(run, handle, ended[i])
            yield cluster, links, ended
            tg.cancel_scope.cancel()


async def views(cluster: Cluster):
    """The coordinator's table once it has read every message sent before."""
    reply = Reply()
    await cluster._coordinator.send(InspectCluster(reply=reply))
    return await reply.wait()


def params(max_tokens: int = 4) -> shunter.SamplingParams:
    return shunter.SamplingParams(max_tokens=max_tokens, temperature=0)


async def read_all(stream, into: list) -> None:
    """The client: every chunk, or the exception it raised, into `into`."""
    try:
        async with stream:
            async for chunk in stream:
                into.append(chunk)
    except ShunterError as exc:
        into.append(exc)


def leaving_client(cluster: Cluster, max_tokens: int = 4):
    """(its cancel scope, an event set once it has left, the task to start): a client of a
    3-token prompt waiting for its first answer, which the test makes leave, as an HTTP client
    hanging up, by cancelling the scope."""
    client, left = anyio.CancelScope(), anyio.Event()

    async def wait_for_admission() -> None:
        with client:
            async with cluster.generate([1, 2, 3], params(max_tokens)) as stream:
                await stream.__anext__()
        left.set()

    return client, left, wait_for_admission


def tokens(chunks: list) -> list[int]:
    return [t for c in chunks if isinstance(c, GenerationChunk) for t in c.token_ids]


def chunk(key: int, ids: tuple[int, ...], finish: str | None = None) -> GenerationChunk:
    return GenerationChunk(request_id=key, token_ids=ids, text="", finish_reason=finish)


# ------------------------------------------------------------------ the client stream protocol

@pytest.mark.parametrize("admitted_before_death", [False, True])
async def test_a_request_handed_back_reaches_its_client_whole_and_in_order(admitted_before_death):
    """Instance 0 dies before `Admitted` or between `Admitted` and the first chunk: the client
    gets instance 1's tokens, each once, in order (CI's kill test, forced here)."""
    async with stand_in_cluster() as (cluster, links, _):
        got: list = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all, cluster.generate([1, 2, 3], params()), got)
            sub = await links[0].next_sent()
            if admitted_before_death:
                await links[0].answer(sub.key, Admitted(request_id=40))
            links[0].peer_send.close()
            again = await links[1].next_sent()
            assert isinstance(again, SubmitRequest) and again.key == sub.key
            await links[1].answer(sub.key, Admitted(request_id=9), chunk(9, (5, 6)),
                                  chunk(9, (7, 8), "length"))
        assert tokens(got) == [5, 6, 7, 8]
        assert got[-1].finish_reason == "length" and got[-1].request_id == sub.key
        assert [v.in_flight for v in await views(cluster)] == [0, 0]


async def test_a_client_that_leaves_before_its_admission_has_its_request_cancelled():
    """It had no id to cancel with: the front door, finding it gone when `Admitted` comes,
    cancels the request on its instance (before: the instance ran it to its end)."""
    async with stand_in_cluster(1) as (cluster, links, _):
        client, left, wait_for_admission = leaving_client(cluster, 1000)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_admission)
            sub = await links[0].next_sent()
            client.cancel()  # an HTTP client hanging up while its request is dispatched
            await left.wait()
            await links[0].answer(sub.key, Admitted(request_id=1))
            assert await links[0].next_sent() == CancelRequest(key=sub.key)
        assert cluster.instances[0].live_requests == 0
        assert [v.in_flight for v in await views(cluster)] == [0]


async def test_a_client_cancelled_during_its_dispatch_leaves_nothing_counted():
    """The client's task was cancelled while the coordinator chose its instance (an HTTP
    client hanging up): the dispatch completes, the request is cancelled on its instance once
    it answers, and nothing stays counted in flight (before: the coordinator counted the
    request on instance 0 for ever, and `wait_idle` never returned)."""
    async with stand_in_cluster() as (cluster, links, _):
        real, scripted = cluster._coordinator, anyio.create_memory_object_stream(math.inf)
        cluster._coordinator = scripted[0]
        client, left, wait_for_admission = leaving_client(cluster, 1000)

        async def coordinator() -> None:
            async for msg in scripted[1]:
                if isinstance(msg, ChooseInstance):
                    client.cancel()  # while the client's task waits for this answer
                real.send_nowait(msg)  # (no checkpoint between: the choice is always made)

        async with anyio.create_task_group() as tg:
            tg.start_soon(coordinator)
            tg.start_soon(wait_for_admission)
            await left.wait()
            cluster._coordinator = real  # what follows reaches the coordinator in order
            if links[0].sent:  # dispatched whole: the instance answers, the request is cancelled
                sub = links[0].sent[0]
                await links[0].answer(sub.key, Admitted(request_id=1))
                assert await links[0].next_sent() == sub
                assert await links[0].next_sent() == CancelRequest(key=sub.key)
            tg.cancel_scope.cancel()
        assert [v.in_flight for v in await views(cluster)] == [0, 0]


async def test_a_request_whose_client_left_is_not_dispatched_again_when_its_instance_dies():
    """The cancel raced with the hand-back (the client left before the request's `Admitted`,
    or while it was being dispatched again): nothing is sent to another instance."""
    async with stand_in_cluster() as (cluster, links, ended):
        client, left, wait_for_admission = leaving_client(cluster, 1000)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_admission)
            await links[0].next_sent()
            client.cancel()
            await left.wait()
        links[0].peer_send.close()
        await ended[0].wait()  # instance 0's requests handed back, or not
        assert links[1].sent == []
        assert [v.in_flight for v in await views(cluster)] == [0, 0]


async def test_an_instance_whose_engine_stopped_before_admitting_hands_the_request_on():
    """Its engine stopped (an actor failed) while its process lives, before the monitor's
    next round: the request it refused with EngineDeadError goes to a live instance (before:
    the client got EngineDeadError though the cluster serves)."""
    async with stand_in_cluster() as (cluster, links, _):
        got: list = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all, cluster.generate([1, 2, 3], params()), got)
            sub = await links[0].next_sent()
            await links[0].answer(sub.key, Rejected(error=DIED))
            again = await links[1].next_sent()
            assert again.key == sub.key
            await links[1].answer(sub.key, Admitted(request_id=3), chunk(3, (4, 5), "length"))
        assert tokens(got) == [4, 5] and got[-1].finish_reason == "length"
        table = await views(cluster)
        assert [v.alive for v in table] == [False, True]
        assert [v.in_flight for v in table] == [0, 0]
        assert cluster.instances[0].failure == f"instance 0: {DIED}"


async def test_a_dead_instance_the_coordinator_chose_counts_nothing_in_flight():
    """The coordinator chose instance 0 before it heard of its death; the request is served
    on instance 1, and instance 0's count of requests in flight goes back to 0 (before: it
    kept 1 for ever, so `wait_idle` never returned)."""
    async with stand_in_cluster() as (cluster, links, _):
        cluster.instances[0].failure = "instance 0 was killed"  # the coordinator not told yet
        got: list = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all, cluster.generate([1, 2, 3], params()), got)
            sub = await links[1].next_sent()
            await links[1].answer(sub.key, Admitted(request_id=3), chunk(3, (4,), "length"))
        assert tokens(got) == [4]
        assert [v.in_flight for v in await views(cluster)] == [0, 0]
        assert links[0].sent == []


async def test_a_request_streaming_when_its_instance_dies_is_told_the_process_fate():
    """The monitor's question found the link broken before the reader saw it end: the
    streamed request's error still names the process's fate (before: "instance 0: instance 0:
    its link is closed", so under load CI's kill test could see that message)."""
    async with stand_in_cluster(1) as (cluster, links, _):
        got: list = []
        streamed = anyio.Event()

        async def stream_one() -> None:
            async with cluster.generate([1, 2], params(100)) as stream:
                async for c in stream:
                    got.append(c)
                    streamed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream_one)
            sub = await links[0].next_sent()
            await links[0].answer(sub.key, Admitted(request_id=1), chunk(1, (9,)))
            await streamed.wait()
            links[0].broken = True  # killed: a send now fails ...
            await cluster._monitor_round()
            assert not cluster.instances[0].alive
            links[0].peer_send.close()  # ... and the reader sees the link end after
        assert tokens(got) == [9] and got[-1].finish_reason == "error"
        assert got[-1].error == ("instance 0 was killed; the request had streamed tokens, so it "
                                 "was not sent to another instance")


# ------------------------------------------------------------------ shutdown

async def test_requests_in_flight_end_when_the_cluster_shuts_down():
    """One client streaming, one waiting for its admission answer: both get EngineDeadError
    (before: both waited for ever)."""
    async with stand_in_cluster() as (cluster, links, _):
        streaming, waiting = [], []
        first = anyio.Event()

        async def stream_one() -> None:
            try:
                async with cluster.generate([1, 2], params(100)) as stream:
                    async for c in stream:
                        streaming.append(c)
                        first.set()
            except EngineDeadError as exc:
                streaming.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream_one)
            a = await links[0].next_sent()
            await links[0].answer(a.key, Admitted(request_id=1), chunk(1, (9,)))
            await first.wait()
            tg.start_soon(read_all, cluster.generate([3, 4], params()), waiting)
            await links[1].next_sent()
            with anyio.fail_after(GUARD_S):
                await cluster._close_instances(detach=False)
        assert tokens(streaming) == [9]
        for got in (streaming, waiting):
            assert isinstance(got[-1], EngineDeadError)
            assert str(got[-1]) == "the cluster shut down"
        assert Shutdown() in links[0].sent and Shutdown() in links[1].sent


async def test_a_request_dispatched_while_the_cluster_shuts_down_ends():
    """The cluster shut down during the request's coordinator round trip: its client gets
    EngineDeadError (before: it was sent to a closed instance handle and waited for ever)."""
    async with stand_in_cluster() as (cluster, links, _):
        real, scripted = cluster._coordinator, anyio.create_memory_object_stream(math.inf)
        cluster._coordinator = scripted[0]

        async def coordinator() -> None:
            async for msg in scripted[1]:
                if isinstance(msg, ChooseInstance):
                    await cluster._close_instances(detach=False)  # while it waits for this
                await real.send(msg)

        got: list = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(coordinator)
            await read_all(cluster.generate([1, 2, 3], params()), got)
            tg.cancel_scope.cancel()
        assert isinstance(got[-1], EngineDeadError) and str(got[-1]) == "the cluster shut down"
        assert not any(isinstance(m, SubmitRequest) for link in links for m in link.sent)


async def test_a_choice_left_in_the_coordinator_inbox_when_it_stops_fails():
    """The cluster shut down (its coordinator cancelled) with a choice still unanswered in
    the coordinator's inbox: the choice fails with EngineDeadError, and a later one cannot be
    asked (a dispatch is shielded from its client's cancellation, so without this it would
    wait for ever)."""

    class Unanswering:
        async def run(self, *, task_status) -> None:
            task_status.started()
            await anyio.sleep_forever()

    cluster = Cluster(EngineConfig(backend="sim"), None, 1, 1.0, None, None)
    cluster._coordinator, inbox = anyio.create_memory_object_stream(math.inf)
    reply = Reply()
    async with anyio.create_task_group() as tg:
        await tg.start(cluster._run_coordinator, Unanswering(), inbox)
        await cluster._coordinator.send(ChooseInstance(demand_tokens=10, reply=reply))
        await cluster._close_instances(detach=False)
        tg.cancel_scope.cancel()  # as the cluster's task group is at the end of its block
    with anyio.fail_after(GUARD_S), pytest.raises(EngineDeadError, match="the cluster shut down"):
        await reply.wait()
    with pytest.raises(EngineDeadError, match="the cluster shut down"):
        await cluster._choose(10)


async def test_an_instance_dying_while_the_cluster_shuts_down_fails_only_its_requests():
    """Its unstreamed request cannot be dispatched again: the client gets EngineDeadError
    (before: the hand-back raised in the handle's task and took the cluster down)."""
    async with stand_in_cluster() as (cluster, links, _):
        got: list = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all, cluster.generate([1, 2, 3], params()), got)
            await links[0].next_sent()
            cluster._closed = True  # shutting down, instance 0 not yet told
            links[0].peer_send.close()  # killed with the terminal's Ctrl-C, say
        assert isinstance(got[-1], EngineDeadError) and str(got[-1]) == "the cluster shut down"


async def test_a_client_that_left_while_every_instance_went_down_takes_nothing_down():
    """The hand-back finds no instance left, and the client left during that round trip:
    its refusal goes nowhere, quietly (before: the send raised in the handle's task)."""
    async with stand_in_cluster(1) as (cluster, links, ended):
        real, scripted = cluster._coordinator, anyio.create_memory_object_stream(math.inf)
        cluster._coordinator = scripted[0]
        client, left, wait_for_tokens = leaving_client(cluster)

        async def coordinator() -> None:
            async for msg in scripted[1]:
                if isinstance(msg, ChooseInstance) and cluster.table.dispatches == 0:
                    await real.send(msg)  # the first choice: instance 0
                elif isinstance(msg, ChooseInstance):  # the hand-back's
                    client.cancel()  # the client leaves during the round trip
                    await left.wait()
                    msg.reply.fail(NoInstanceError("every instance of the cluster is down"))
                else:
                    await real.send(msg)

        async with anyio.create_task_group() as tg:
            tg.start_soon(coordinator)
            tg.start_soon(wait_for_tokens)
            sub = await links[0].next_sent()
            await links[0].answer(sub.key, Admitted(request_id=1))
            links[0].peer_send.close()
            await ended[0].wait()
            assert left.is_set()
            tg.cancel_scope.cancel()


async def test_questions_pending_when_a_marked_down_instance_dies_are_answered():
    """`inspect` asked, the monitor marked the instance down, then its process died: the
    question fails with EngineDeadError (before: it waited for ever)."""
    async with stand_in_cluster(1) as (cluster, links, ended):
        handle, answers = cluster.instances[0], []

        async def ask() -> None:
            try:
                answers.append(await handle.snapshot())
            except EngineDeadError as exc:
                answers.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            assert isinstance(await links[0].next_sent(), AskSnapshot)
            await handle.mark_down("instance 0: the scheduler actor failed")
            links[0].peer_send.close()
            with anyio.fail_after(GUARD_S):
                await ended[0].wait()
        assert isinstance(answers[0], EngineDeadError)
        assert "scheduler actor failed" in str(answers[0])


async def test_a_policy_replaced_while_instances_go_down_reaches_every_live_one():
    """Instance 0's link broke (its process died) and instance 1's engine stopped, neither
    marked down yet: the policy goes to instance 2, the cluster runs it, and the two are marked
    down (before: the replacement raised EngineDeadError, a 500 from `PUT /admin/policy`, or a
    PolicyError blaming the policy for instance 1's dead engine, after some instances had
    switched and the cluster had not)."""
    config = EngineConfig(backend="sim")
    capabilities = engine_capabilities(config)
    async with stand_in_cluster(3) as (cluster, links, _):
        cluster.policy, cluster.capabilities = initial_policy(config, None, capabilities), \
            capabilities
        links[0].broken = True

        async def instances() -> None:
            ask = await links[1].next_sent()
            await links[1].peer_send.send(PolicyReplaced(key=ask.key, error=str(DIED),
                                                         engine_stopped=True))
            ask = await links[2].next_sent()
            await links[2].peer_send.send(PolicyReplaced(key=ask.key))

        async with anyio.create_task_group() as tg:
            tg.start_soon(instances)
            new = await cluster.replace_policy("policy lb { dispatch least_load }")
        assert cluster.policy is new and cluster.policy_version == 2
        assert [i.alive for i in cluster.instances] == [False, False, True]
        assert cluster.instances[1].failure == f"instance 1: {DIED}"
        assert [v.alive for v in await views(cluster)] == [False, False, True]


# ------------------------------------------------------------------ the instance's side

class StandInEngine:
    """What `InstanceServer` and `InProcessInstance` use of an Engine; the test reads the
    submissions from `submitted` and plays the engine's frontend on their output streams."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(block_size=4)
        self.backend = SimpleNamespace(vocab_size=97, runner=None)
        self.policy = SimpleNamespace(source="policy fcfs { }")
        self._send, self.submitted = anyio.create_memory_object_stream(math.inf)
        self.stopped: str | None = None
        self.cancelled: list[int] = []

    async def _submit(self, msg) -> None:
        if self.stopped is not None:
            raise EngineDeadError(self.stopped)
        self._send.send_nowait(msg)

    def _cancel_nowait(self, request_id: int) -> None:
        self.cancelled.append(request_id)

    def stopped_reason(self) -> str:
        return self.stopped or "the engine stopped"

    async def inspect(self):
        raise EngineDeadError("a stand-in engine has no snapshot")

    async def replace_policy(self, text: str) -> None:
        if self.stopped is not None:
            raise EngineDeadError(self.stopped)

    async def next_submitted(self):
        with anyio.fail_after(GUARD_S):
            return await self.submitted.receive()


def submit_request(key: int) -> SubmitRequest:
    return SubmitRequest(key=key, prompt=None, prompt_ids=(1, 2, 3), sampling=params(),
                         scheduling=shunter.SchedulingParams())


async def test_the_instance_refuses_what_its_stopped_engine_never_admitted():
    """A submission queued in the engine when it stopped (its stream closed unanswered), and
    one that came after: each is refused with EngineDeadError, never answered with a chunk
    (before, the first got an error chunk with no `Admitted`: a protocol break)."""
    engine, link = StandInEngine(), Link()
    server = InstanceServer(engine, link)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.run)
        assert isinstance(await link.next_sent(), Hello)
        await link.peer_send.send(submit_request(5))
        queued = await engine.next_submitted()
        engine.stopped = str(DIED)
        queued.outputs.close()  # what the frontend does to queued submissions as it stops
        for key in (5, 6):
            if key == 6:
                await link.peer_send.send(submit_request(6))
            out = await link.next_sent()
            assert out.key == key and isinstance(out.output, Rejected)
            assert isinstance(out.output.error, EngineDeadError)
            assert str(out.output.error) == str(DIED)
        await link.peer_send.send(Shutdown())


async def test_the_in_process_handle_hands_on_what_its_stopped_engine_never_admitted():
    engine, handed_back, down, handed = StandInEngine(), [], [], anyio.Event()

    async def redispatch(key: int, submit, announced: bool, since: float) -> None:
        handed_back.append((key, announced))
        handed.set()

    async def on_down(index: int, reason: str) -> None:
        down.append(reason)

    handle = InProcessInstance(0, engine, on_end=lambda key: None, redispatch=redispatch,
                               on_down=on_down)
    client = cluster_submit()
    async with anyio.create_task_group() as tg:
        await tg.start(handle.run)
        await handle.submit(7, client[0])
        queued = await engine.next_submitted()
        engine.stopped = str(DIED)
        queued.outputs.close()
        with anyio.fail_after(GUARD_S):
            await handed.wait()
        tg.cancel_scope.cancel()
    assert handed_back == [(7, False)] and down == [f"instance 0: {DIED}"]
    with pytest.raises(anyio.WouldBlock):
        client[1].receive_nowait()  # the client heard nothing: the next instance answers it


def cluster_submit():
    from engine.messages import Submit

    send, recv = anyio.create_memory_object_stream(math.inf)
    return Submit(prompt=None, prompt_ids=[1, 2, 3], sampling=params(),
                  scheduling=shunter.SchedulingParams(), outputs=send), recv


async def test_the_instance_survives_its_link_breaking_under_a_relay_and_serves_the_next():
    """The front door detached while a request was still streaming: the relay's send fails,
    and the instance still waits for the next front door (before: the send's error ended the
    instance's process, and the next test sharing it found nothing to attach to)."""
    engine, link = StandInEngine(), Link()
    server = InstanceServer(engine, link)
    result: list[bool] = []

    async def serve() -> None:
        result.append(await server.run())

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)
        await link.next_sent()  # Hello
        await link.peer_send.send(submit_request(5))
        sub = await engine.next_submitted()
        link.broken = True
        sub.outputs.send_nowait(Admitted(request_id=1))
        with anyio.fail_after(GUARD_S):
            await link.send_failed.wait()
        await link.peer_send.send(Detach())
    assert result == [True]


async def test_a_cancel_that_comes_before_the_engine_admitted_the_request_applies_once_it_does():
    """The instance read the cancel before its engine answered the submission: it cancels
    the request as soon as the engine names its id."""
    engine, link = StandInEngine(), Link()
    async with anyio.create_task_group() as tg:
        tg.start_soon(InstanceServer(engine, link).run)
        await link.next_sent()  # Hello
        await link.peer_send.send(submit_request(5))
        await link.peer_send.send(CancelRequest(key=5))
        await link.peer_send.send(AskSnapshot(key=0))  # answered once the cancel was read
        assert isinstance(await link.next_sent(), Snapshot)
        sub = await engine.next_submitted()
        sub.outputs.send_nowait(Admitted(request_id=11))
        assert (await link.next_sent()).output == Admitted(request_id=11)
        assert engine.cancelled == [11]
        await link.peer_send.send(Shutdown())


async def test_an_instance_whose_engine_stopped_says_so_when_asked_to_replace_its_policy():
    engine, link = StandInEngine(), Link()
    engine.stopped = str(DIED)
    async with anyio.create_task_group() as tg:
        tg.start_soon(InstanceServer(engine, link).run)
        await link.next_sent()  # Hello
        await link.peer_send.send(ReplacePolicyText(key=3, text="policy x { }"))
        assert await link.next_sent() == PolicyReplaced(key=3, error=str(DIED),
                                                        engine_stopped=True)
        await link.peer_send.send(Shutdown())


async def test_an_instance_left_by_its_front_door_cancels_what_it_was_serving():
    """The front door detached (or its link dropped) while a request streamed: the instance
    cancels it at once (before: its engine held the request, and its blocks, until its next
    output found nobody listening, which for a waiting or swapped request may be long)."""
    engine, link = StandInEngine(), Link()
    async with anyio.create_task_group() as tg:
        tg.start_soon(InstanceServer(engine, link).run)
        await link.next_sent()  # Hello
        await link.peer_send.send(submit_request(5))
        sub = await engine.next_submitted()
        sub.outputs.send_nowait(Admitted(request_id=11))
        assert (await link.next_sent()).output == Admitted(request_id=11)
        await link.peer_send.send(Detach())
    assert engine.cancelled == [11]
