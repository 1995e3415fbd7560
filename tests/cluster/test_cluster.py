"""A cluster of instance processes behind the coordinator: outputs equal transformers', the
dispatch rule spreads the load, and killing an instance mid-run fails (or re-dispatches) only
its own requests while the cluster goes on serving."""

from __future__ import annotations

import sys

import anyio
import pytest

import shunter
from shunter.cluster.cluster import Cluster
from tests.cluster.prompts import MAX_TOKENS, PROMPTS
from tests.proc_status import ignores_sigint
from tests.reference import assert_matches, greedy_reference


async def _complete_all(cluster: Cluster, prompts, max_tokens: int) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()] * len(prompts)

    async def one(i: int) -> None:
        done = await cluster.complete(prompts[i], shunter.SamplingParams(
            max_tokens=max_tokens, temperature=0))
        out[i] = tuple(done.token_ids)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return out


@pytest.mark.anyio
async def test_two_instances_serve_32_concurrent_prompts_like_transformers(
        cluster_config, local_instances, tiny_llama_dir):
    async with Cluster.start(cluster_config, attach=local_instances) as cluster:
        got = await _complete_all(cluster, PROMPTS, MAX_TOKENS)
        snap = await cluster.wait_idle()
    for i, tokens in enumerate(got):
        assert_matches(tokens, greedy_reference(tiny_llama_dir, PROMPTS[i], MAX_TOKENS),
                       f"prompt {i}")
    # fcfs dispatches round-robin: 16 each; the monitor saw both instances' pools
    assert [v.in_flight for v in snap.views] == [0, 0]
    assert [cluster.table.dispatched_to(i) for i in range(2)] == [16, 16]
    assert [s.scheduler.total_blocks for s in snap.snapshots] == [64, 64]


@pytest.mark.anyio
async def test_killing_an_instance_ends_only_its_requests_and_the_cluster_serves_on(
        anyio_backend, cluster_config, local_instances, local_launcher, tiny_llama_dir):
    if anyio_backend != "trio":
        pytest.skip("one event loop is enough: this test spawns and kills its own process")
    doomed = await anyio.to_thread.run_sync(local_launcher.start_process, 2, cluster_config)
    max_tokens = 32
    prompts = PROMPTS[:9]
    results: dict[int, tuple[list[int], str, str | None]] = {}
    streamed_from_doomed = anyio.Event()

    async def one(cluster: Cluster, i: int) -> None:
        tokens: list[int] = []
        async with cluster.generate(prompts[i], shunter.SamplingParams(
                max_tokens=max_tokens, temperature=0)) as stream:
            async for chunk in stream:
                tokens.extend(chunk.token_ids)
                if tokens and cluster._where.get(chunk.request_id, (None,))[0] == 2:
                    streamed_from_doomed.set()
                if chunk.finish_reason is not None:
                    results[i] = (tokens, chunk.finish_reason, chunk.error)

    async with Cluster.start(cluster_config, attach=[*local_instances, doomed]) as cluster:
        # a request of the doomed instance can end (EOS) before the kill lands under load: it
        # is neither failed nor dispatched again
        handle, ended_before_kill = cluster.instances[2], []
        finish = handle._finish

        def spy(key: int) -> None:
            if handle.failure is None:
                ended_before_kill.append(key)
            finish(key)

        handle._finish = spy
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, cluster, i)
            await streamed_from_doomed.wait()
            doomed.kill()
        failed = {i for i, (_, reason, _) in results.items() if reason == "error"}
        assert failed, "the killed instance had requests streaming"
        for i in failed:
            tokens, _, error = results[i]
            assert tokens, "only requests that had streamed tokens fail"
            assert error == (f"instance 2 (pid {doomed.pid}) went away (killed by signal 9); the "
                             f"request had streamed tokens, so it was not sent to another instance")
        for i in set(results) - failed:
            assert_matches(results[i][0], greedy_reference(tiny_llama_dir, prompts[i], max_tokens),
                           f"prompt {i}")
        assert len(results) == len(prompts)
        # the doomed instance's requests that had streamed nothing were dispatched again
        redispatched = cluster.table.dispatches - len(prompts)
        assert redispatched == cluster.table.dispatched_to(2) - len(failed) - len(ended_before_kill)
        # new requests go to the live instances only, and are served correctly
        before = cluster.table.dispatched_to(2)
        again = await _complete_all(cluster, PROMPTS[12:18], MAX_TOKENS)
        for k, tokens in enumerate(again):
            ref = greedy_reference(tiny_llama_dir, PROMPTS[12 + k], MAX_TOKENS)
            assert_matches(tokens, ref, f"new {k}")
        assert cluster.table.dispatched_to(2) == before
        snap = await cluster.inspect()
        assert [v.alive for v in snap.views] == [True, True, False]
        assert snap.failures[2].startswith("instance 2 (pid ")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_instance_processes_leave_ctrl_c_to_the_front_door(local_instances):
    """Ctrl-C in a terminal signals the whole process group: the instances ignore SIGINT (each
    ends when its front door's link closes), so `shunter serve --instances N` drains its
    running requests as it does with one engine (before: each instance died of
    KeyboardInterrupt at once, with a traceback, and its requests failed)."""
    for inst in local_instances:
        assert ignores_sigint(inst.pid), inst.pid
