"""An instance that goes silent without closing its link (SIGSTOP keeps its sockets open, as a
host cut off the network does) is declared lost by the front door's heartbeat within
`Liveness.silent_after_s`, and handled as a dead one: streamed requests end with an error naming
it and that it went silent, unstreamed ones are served elsewhere, equal to transformers'. One
stopped for less than that and continued is not lost. (Across hosts with the network cut:
test_heartbeat_netns.py.)"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time

import anyio
import pytest

import shunter
from shunter.cluster.cluster import Cluster
from engine.errors import ConfigError
from shunter.cluster.handles import RemoteInstance
from shunter.cluster.heartbeat import Liveness
from shunter.cluster.wire import Ping, Pong
from tests.cluster.prompts import PROMPTS
from tests.reference import assert_matches, greedy_reference

LIVENESS = Liveness(interval_s=0.1, silent_after_s=1.5)
MAX_TOKENS = 24


class _Peer:
    """A stand-in control link whose instance answers each `Ping` `rtt` seconds later (while
    `answering`)."""

    def __init__(self, rtt: float = 0.1) -> None:
        self.peer_send, self._recv = anyio.create_memory_object_stream(math.inf)
        self._pings, self._asked = anyio.create_memory_object_stream(math.inf)
        self.answering = True
        self.rtt = rtt
        self.outstanding = 0
        self.full = False
        """Sends block until the link is closed (a cut-off peer's full buffer; `Link.send`
        is shielded from cancellation)."""
        self._closed = anyio.Event()

    async def send(self, msg: object) -> None:
        if self.full:
            with anyio.move_on_after(4, shield=True):  # the buffer would drain, in 4 s
                await self._closed.wait()
            raise anyio.ClosedResourceError
        if isinstance(msg, Ping) and self.answering:
            self._pings.send_nowait((anyio.current_time() + self.rtt, msg.seq))
            self.outstanding += 1

    async def answer(self) -> None:
        async for due, seq in self._asked:
            await anyio.sleep_until(due)
            if self.answering:
                with contextlib.suppress(anyio.BrokenResourceError):  # the handle let go
                    self.peer_send.send_nowait(Pong(seq=seq))
                self.outstanding -= 1

    async def receive(self) -> object:
        return await self._recv.receive()

    async def aclose(self) -> None:
        self._recv.close()
        self._closed.set()


async def _watch(peer: _Peer, liveness: Liveness, during,
                 downs: list[str] | None = None) -> tuple[RemoteInstance, list[str]]:
    downs = [] if downs is None else downs

    async def on_down(index: int, reason: str) -> None:
        downs.append(reason)

    handle = RemoteInstance(3, peer, on_end=lambda key: None, redispatch=None, on_down=on_down,
                            describe_death=lambda: "", kill=lambda: None, liveness=liveness)
    async with anyio.create_task_group() as tg:
        tg.start_soon(peer.answer)
        await tg.start(handle.run)
        await during(handle)
        tg.cancel_scope.cancel()
    return handle, downs


@pytest.mark.anyio
async def test_a_front_door_stalled_itself_does_not_lose_an_answering_instance():
    """The front door's own loop blocked longer than the silence allowed (a long synchronous
    call): it sent no pings meanwhile, so the instance is not blamed (the silence counts from
    an unanswered ping, not from the last message)."""
    peer = _Peer(rtt=0.1)  # longer than the front door's second look (0.05 s)

    async def stall(handle: RemoteInstance) -> None:
        await anyio.sleep(0.5)
        while peer.outstanding:  # just after an answer: no ping waits through the stall
            await anyio.sleep(0.005)
        time.sleep(1.0)  # blocks this event loop: no ping, no read
        await anyio.sleep(0.6)

    handle, downs = await _watch(peer, Liveness(interval_s=0.2, silent_after_s=0.5), stall)
    assert downs == [] and handle.alive, downs
    assert handle.heartbeat.pings >= 4


@pytest.mark.anyio
async def test_an_instance_that_stops_answering_is_lost_after_the_silence():
    peer = _Peer()
    lost_after: list[float] = []

    async def go_silent(handle: RemoteInstance) -> None:
        await anyio.sleep(0.3)
        peer.answering, since = False, anyio.current_time()
        with anyio.fail_after(5):
            lost_after.append(await until_gone(handle) - since)

    handle, downs = await _watch(peer, Liveness(interval_s=0.05, silent_after_s=0.4), go_silent)
    assert 0.4 <= lost_after[0] < 1.5, lost_after
    assert downs == [handle.failure]
    assert downs[0].startswith("instance 3 went silent: no answer to a ping for "), downs


@pytest.mark.anyio
async def test_a_ping_stuck_in_a_full_buffer_does_not_hold_the_loss_up():
    """A cut-off peer whose send buffer filled: the ping's send blocks, shielded. The handle
    closes the link before it waits for its senders, so the loss goes through (plant: closing
    it only after them hangs)."""
    peer = _Peer()

    async def cut_off(handle: RemoteInstance) -> None:
        await anyio.sleep(0.3)
        peer.answering, peer.full = False, True
        began = anyio.current_time()
        while not downs and anyio.current_time() - began < 6:
            await anyio.sleep(0.01)
        waited.append(anyio.current_time() - began)

    downs: list[str] = []
    waited: list[float] = []
    handle, got = await _watch(peer, Liveness(interval_s=0.05, silent_after_s=0.4), cut_off,
                               downs)
    assert got and got[0].startswith("instance 3 went silent"), got
    assert waited[0] < 2.0, f"lost {waited[0]:.1f} s after the cut (0.4 s allowed)"


def test_liveness_settings_are_checked():
    with pytest.raises(ConfigError, match="more than twice interval_s"):
        Liveness(interval_s=1.0, silent_after_s=1.5)
    with pytest.raises(ConfigError, match="interval_s must be > 0"):
        Liveness(interval_s=0)


async def _serve(cluster: Cluster, prompts, results: dict, on_chunk=lambda key, tokens: None):
    async def one(i: int) -> None:
        tokens: list[int] = []
        async with cluster.generate(prompts[i], shunter.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0)) as stream:
            async for chunk in stream:
                tokens.extend(chunk.token_ids)
                on_chunk(chunk.request_id, tokens)
                if chunk.finish_reason is not None:
                    results[i] = (tokens, chunk.finish_reason, chunk.error)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)


async def until_gone(handle) -> float:
    """Wait until the front door counts instance `handle` gone; return when it did."""
    while handle.alive:
        await anyio.sleep(0.01)
    return anyio.current_time()


def _check_equal(results: dict, prompts, model_dir, what: str) -> None:
    for i, (tokens, reason, error) in results.items():
        assert reason != "error", (what, i, error)
        assert_matches(tokens, greedy_reference(model_dir, prompts[i], MAX_TOKENS), f"{what} {i}")


@pytest.mark.anyio
async def test_a_stopped_instance_is_lost_after_the_silence_and_a_paused_one_is_not(
        anyio_backend, cluster_config, local_instances, local_launcher, tiny_llama_dir):
    if anyio_backend != "trio":
        pytest.skip("one event loop is enough: this test spawns and stops its own process")
    doomed = await anyio.to_thread.run_sync(local_launcher.start_process, 2, cluster_config)
    async with Cluster.start(cluster_config, attach=[*local_instances, doomed],
                             liveness=LIVENESS) as cluster:
        handle = cluster.instances[2]
        # a pause shorter than the silence allowed (a long step, a slow host): not lost
        first = PROMPTS[:6]
        paused: dict = {}
        os.kill(doomed.pid, signal.SIGSTOP)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_serve, cluster, first, paused)
            await anyio.sleep(0.8)
            os.kill(doomed.pid, signal.SIGCONT)
        assert handle.alive, handle.failure
        paused_gap = handle.heartbeat.longest_wait_s
        assert paused_gap >= 0.5, paused_gap
        assert len(paused) == len(first)
        _check_equal(paused, first, tiny_llama_dir, "paused")

        # stopped for good, with requests streaming from it and new ones sent to it; the
        # others are told (their data planes count it gone: no connection of it ever closes)
        told: list[tuple[int, int]] = []
        for other in cluster.instances[:2]:
            async def spy(index: int, other=other, real=other.peer_lost) -> None:
                told.append((other.index, index))
                await real(index)
            other.peer_lost = spy
        prompts = PROMPTS[6:18]
        results: dict = {}
        streamed = anyio.Event()
        stopped_at = lost_at = None
        dispatched_before = cluster.table.dispatches

        def on_chunk(key: int, tokens: list[int]) -> None:
            if tokens and cluster._where.get(key, (None,))[0] == 2:
                streamed.set()

        async def watch_down() -> None:
            nonlocal lost_at
            lost_at = await until_gone(handle)

        late: dict = {}  # dispatched while the front door still thinks it alive
        # (without the heartbeat, the requests on the stopped instance wait for ever)
        with anyio.move_on_after(60) as waited:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_serve, cluster, prompts[:9], results, on_chunk)
                await streamed.wait()
                os.kill(doomed.pid, signal.SIGSTOP)
                stopped_at = anyio.current_time()
                tg.start_soon(watch_down)
                await _serve(cluster, prompts[9:], late)
        assert not waited.cancelled_caught, (
            f"the stopped instance's requests did not end in 60 s: not declared lost "
            f"({handle.heartbeat.pings} pings, failure {handle.failure!r})")
        print(f"lost {lost_at - stopped_at:.2f} s after SIGSTOP; paused gap "
              f"{paused_gap:.2f} s; {handle.heartbeat.pings} pings")
        results.update({9 + i: r for i, r in late.items()})
        took = lost_at - stopped_at
        assert LIVENESS.silent_after_s <= took < LIVENESS.silent_after_s + 3.0, took
        assert handle.failure.startswith("instance 2 went silent: no answer to a ping for ")
        assert sorted(told) == [(0, 2), (1, 2)], told
        failed = {i for i, r in results.items() if r[1] == "error"}
        assert failed, "the stopped instance had requests streaming"
        for i in failed:
            tokens, _, error = results[i]
            assert tokens, "only requests that had streamed tokens fail"
            assert error.startswith("instance 2 went silent") and error.endswith(
                "the request had streamed tokens, so it was not sent to another instance"), error
        assert len(results) == len(prompts)
        _check_equal({i: r for i, r in results.items() if i not in failed}, prompts,
                     tiny_llama_dir, "served elsewhere")
        redispatched = cluster.table.dispatches - dispatched_before - len(prompts)
        assert redispatched >= 1, "requests it had not streamed from are served elsewhere"
        # the lost instance's process was ended (it could not come back and serve twice)
        with anyio.fail_after(10):
            while "killed by signal 9" not in doomed.describe_death():
                await anyio.sleep(0.05)
        again: dict = {}
        await _serve(cluster, PROMPTS[20:24], again)
        _check_equal(again, PROMPTS[20:24], tiny_llama_dir, "after")
        assert [v.alive for v in (await cluster.inspect()).views] == [True, True, False]
