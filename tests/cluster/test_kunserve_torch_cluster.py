"""KunServe on a cluster of two torch instance processes (gloo), driven by the coordinator: a
burst that the instances' small pools cannot hold makes the global monitor drop (the policy's
`overload drop` trigger), the instances form a pipeline group (the member hands its requests to
the head, the KV of every request in flight is exchanged in chunks over the data plane), the
group serves the burst, the restore trigger brings every layer back and both serve alone
again. The group cuts its steps by lookahead (§4.3: Eq. 1-3 fitted per stage, prefills cut
between microbatches). Requests whose generation spans drop -> exchange -> pipelined decoding
-> restore give exactly transformers' greedy tokens (tests/reference.py's near-tie rule).

Planted bugs checked by hand (see /work/notes/issue16_torch_cluster.md and
issue16_torch_round3.md): a receiver that skips one exchanged KV chunk, a microbatch that drops
a sequence, and pieces of a cut prefill that all start at its first token each make the first
test fail. Other tests: a lost member, and that every policy of the ladder loads (a lost head
and queued requests moving to a head: test_kunserve_torch_moves.py; faults while a group forms
and the FIFO exchange: test_kunserve_torch_faults.py).
"""

from __future__ import annotations

import random

import anyio
import attrs
import pytest

import shunter
from shunter.cluster.cluster import Cluster
from tests.conftest import slow_scale
from tests.reference import assert_matches, greedy_reference

BLOCK = 4
SOLO_BLOCKS = 24
LONG_TOKENS = 40
"""The long requests: prompt 8 + 40 tokens = 12 blocks each, so the head holds both alone."""
BURST_TOKENS = 32
"""The burst's requests: prompt 16 + 32 tokens = 12 blocks, so an instance holds one beside its
long request. With 8 tokens the overload lasted 4-5 of the monitor's rounds (kun-flake's
recording, load 8-11; 23-25 with 32) and the monitor saw it in one round only, so a front door
slow for 100-200 ms could miss it: no group formed (seen once, in the head-lost test)."""


@pytest.fixture(scope="module")
def kunserve_instances(kunserve_config):
    """Two instance processes, started once for the module (each imports torch)."""
    from shunter.cluster.launch import LocalLauncher

    launcher = LocalLauncher("asyncio")
    yield [launcher.start_process(i, kunserve_config) for i in range(2)]
    launcher.shutdown(timeout_s=0)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 320) for _ in range(n)]


class FaultBurst:
    """The fault tests' requests, `prompts[i] = (prompt, max_tokens)`: the first two long ones,
    then the burst once each streamed 2 tokens, until the monitor groups the two instances.
    Tokens go to `got`, errors to `errors`; a chunk with an error fails the test unless
    `errors_allowed`."""

    def __init__(self, prompts, *, errors_allowed: bool) -> None:
        self.prompts, self.errors_allowed = prompts, errors_allowed
        self.got: dict[int, list[int]] = {}
        self.errors: dict[int, str] = {}
        self.streams: dict = {}

    async def one(self, cluster: Cluster, i: int, started=None) -> None:
        self.got[i] = []
        prompt, n = self.prompts[i]
        async with cluster.generate(prompt, shunter.SamplingParams(
                max_tokens=n, temperature=0)) as stream:
            self.streams[i] = stream
            async for chunk in stream:
                self.got[i] += chunk.token_ids
                if chunk.error is not None:
                    assert self.errors_allowed, (i, chunk.error)
                    self.errors[i] = chunk.error
                if started is not None and len(self.got[i]) >= 2:
                    started.set()

    async def start(self, cluster: Cluster, tg, count: int) -> None:
        """Start requests 0 and 1 in `tg`, and once each streamed 2 tokens, 2 .. count-1."""
        started = [anyio.Event() for _ in range(2)]
        for i in range(2):
            tg.start_soon(self.one, cluster, i, started[i])
        for ev in started:
            await ev.wait()
        for i in range(2, count):
            tg.start_soon(self.one, cluster, i)

    async def until_grouped(self, cluster: Cluster, tg, count: int):
        """`start` them; return the group the monitor forms."""
        await self.start(cluster, tg, count)
        while not cluster.groups.groups:
            await anyio.sleep(0.002)
        (group,) = cluster.groups.groups.values()
        return group


async def _restored_and_idle(cluster: Cluster) -> None:
    """Wait until every request ended and no group runs: when the last requests end before the
    restore (the monitor's round came late), the idle group restores at the next round."""
    await cluster.wait_idle()
    while cluster.groups.groups or cluster.groups.busy:
        await anyio.sleep(0.01)


async def _long_then_burst(cluster: Cluster, longs, burst, got: dict[str, list[int]],
                           times: dict[str, list[float]]) -> None:
    """Start the long requests `L<i>` (LONG_TOKENS each); once each streamed 2 tokens, the
    burst `B<i>` (BURST_TOKENS each) arrives; return when every one ended, its tokens in `got`
    and their arrival times in `times`. A chunk with an error fails the test."""

    async def one(name: str, prompt, max_tokens: int, started=None) -> None:
        got[name], times[name] = [], []
        async with cluster.generate(prompt, shunter.SamplingParams(
                max_tokens=max_tokens, temperature=0)) as stream:
            async for chunk in stream:
                got[name] += chunk.token_ids
                times[name] += [anyio.current_time()] * len(chunk.token_ids)
                assert chunk.error is None, (name, chunk.error)
                if started is not None and len(got[name]) >= 2:
                    started.set()

    async with anyio.create_task_group() as tg:
        started = [anyio.Event() for _ in longs]
        for i, p in enumerate(longs):
            tg.start_soon(one, f"L{i}", p, LONG_TOKENS, started[i])
        for ev in started:
            await ev.wait()
        for i, p in enumerate(burst):
            tg.start_soon(one, f"B{i}", p, BURST_TOKENS)


@pytest.mark.anyio
async def test_burst_drops_groups_and_restores_with_transformers_outputs(
        anyio_backend, kunserve_config, kunserve_instances, kunserve_model):
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    rng = random.Random(0)
    burst_n = slow_scale(20, 12)
    longs = [_prompt(rng, 8) for _ in range(2)]
    burst = [_prompt(rng, 16) for _ in range(burst_n)]
    got: dict[str, list[int]] = {}
    times: dict[str, list[float]] = {}

    async with Cluster.start(kunserve_config, attach=kunserve_instances,
                             monitor_interval_s=0.02) as cluster:
        assert cluster.groups is not None, "no KunServe monitor on the torch instances"
        with anyio.fail_after(180):
            await _long_then_burst(cluster, longs, burst, got, times)
            await _restored_and_idle(cluster)
            snap = await cluster.wait_idle()
            head_stats = [await cluster.groups.stats(i) for i in range(2)]
        report = cluster.groups.report(0.0)
    print(f"\nkunserve torch cluster: {report}; instance stats {head_stats}")
    # one drop -> group -> restore cycle, or more: under heavy load (three busy loops on two
    # cores) a second group formed after the first restored (once in six runs); each ends
    assert report["drops"] >= 1 and report["groups_formed"] >= 1, report
    assert report["restores"] == report["groups_formed"], report
    formed = next(e for e in report["events"] if e["event"] == "group")
    restored = next(e for e in report["events"] if e["event"] == "restore")
    assert formed["pool_blocks"] > 3 * SOLO_BLOCKS and formed["adopted_with_kv"] >= 1, formed
    head = head_stats[formed["members"][0]]["head"]
    member = head_stats[formed["members"][1]]["member"]
    assert head["received_bytes"] > 0 and member["sent_bytes"] > 0, (head, member)
    assert member["copied_blocks"] == 0, "kept KV was copied"
    # lookahead (§4.3): the head cut the group's steps. Whether a cut divides a prefill here
    # depends on the fit of measured times (under load it came out alpha -0.05, beta -0.08:
    # none divided) and on the steps' mix; prompts divided for certain, with transformers'
    # outputs, are test_kunserve_torch_split_prefill.py's
    pipe = head["pipeline"]
    assert pipe["microbatch"] == "lookahead" and pipe["steps"] >= 1, pipe
    assert 0 <= pipe["cost_model"]["cuts_by_fit"] <= pipe["steps"] <= pipe["microbatches"], pipe
    assert 0 <= pipe["bubble_ratio"] < 1, pipe
    assert report["kv_exchanged_bytes"] >= head["received_bytes"] > 0, report
    assert 0 <= report["bubble_ratio"] < 1 and report["pipeline_steps"] >= 1, report
    # what holds under any interleaving: both long requests streamed 2 tokens before the burst
    # that forced the drop came, so before the group formed, and every token of theirs is
    # transformers' (below). How many of the rest came in the group and after its restore
    # depends on the load, and all may come before the restore (nothing holds a request back:
    # 22-27 of their 40 came after it at load 4, issue16_torch_round5.md): printed, not
    # asserted. Requests live across drop, exchange, pipelined steps and restore for certain,
    # steps driven by hand: tests/gpu/test_kunserve_torch.py
    assert formed["t"] <= restored["t"], (formed, restored)
    # the restore's weights came back while the group served (shunter/cluster/
    # instance_restore.py) when a request was left for it to serve, unless every one ended
    # before a step carried the pool's shrink (then it restored at once)
    assert restored["prefetched"] or not restored["live_at_leave"] \
        or restored.get("prefetch_state") == "idle", restored
    if head["restore"].get("prefetched"):
        assert head["restore"]["weight_bytes_before"] > 0, head["restore"]
    for i in range(2):
        t = times[f"L{i}"]
        before = sum(x < formed["t"] for x in t)
        after = sum(x > restored["t"] for x in t)
        print(f"L{i}: {before} tokens before the group, {len(t) - before - after} in it, "
              f"{after} after its restore")
        assert before >= 2, (i, before, len(t))
    assert all(s is not None and s.idle for s in snap.snapshots)
    assert [s.scheduler.total_blocks for s in snap.snapshots] == [SOLO_BLOCKS] * 2
    for name, prompt, n in [*((f"L{i}", p, LONG_TOKENS) for i, p in enumerate(longs)),
                            *((f"B{i}", p, BURST_TOKENS) for i, p in enumerate(burst))]:
        assert_matches(got[name], greedy_reference(kunserve_model, prompt, n), name)


def test_torch_engines_run_every_kunserve_policy(kunserve_config):
    """The torch runner claims every group setting (`kv_exchange fifo` and `coordinated`,
    `microbatch tokens` and `lookahead`, `restore_prefetch on` and `off`, `restore_from peer`
    and `host`): the whole ablation ladder loads, each with its own settings (the FIFO exchange
    runs in tests/cluster/test_kunserve_torch_faults.py, the restore's settings in
    test_kunserve_torch_cluster_restore.py)."""
    from policies import policy_path
    from shunter.backends import build_backend
    from shunter.policy_source import engine_capabilities, initial_policy

    backend = build_backend(kunserve_config)
    caps = engine_capabilities(kunserve_config, backend)
    backend.runner.close()
    assert caps.group_modes == {"fifo", "coordinated", "tokens", "lookahead",
                                "restore_prefetch on", "restore_prefetch off",
                                "restore_from peer", "restore_from host"}
    for name in ("kunserve_drop", "kunserve_exchange", "kunserve_lookahead", "kunserve"):
        loaded = initial_policy(attrs.evolve(kunserve_config, policy=policy_path(name)), None,
                                caps).settings.memory
        assert loaded.kv_exchange == ("fifo" if name == "kunserve_drop" else "coordinated")
        assert loaded.microbatch == ("lookahead" if name in ("kunserve_lookahead", "kunserve")
                                     else "tokens"), name


@pytest.mark.anyio
async def test_in_process_torch_engines_refuse_overload_rules_at_load(anyio_backend,
                                                                      kunserve_config):
    """Groups form over torch instance processes: in-process torch engines would load a
    KunServe policy and never drop a layer, so its `overload` rule is refused at load with its
    place in the file; a policy without one loads."""
    from engine.errors import PolicyError
    from policies import policy_path

    if anyio_backend != "asyncio":
        pytest.skip("the refusal does not depend on the event loop")
    with pytest.raises(PolicyError, match=r"kunserve_torch\.policy:2:\d+: overload triggers "
                                          r"cannot act here: KunServe's pipeline groups form "
                                          r"over torch instance processes"):
        async with Cluster.start(kunserve_config, kind="inprocess"):
            pass
    fcfs = attrs.evolve(kunserve_config, policy=policy_path("fcfs"))
    async with Cluster.start(fcfs, kind="inprocess", instances=1) as cluster:
        assert cluster.policy.settings.name == "fcfs" and cluster.groups is None


@pytest.mark.anyio
async def test_a_ray_cluster_forms_groups_over_its_instances_addresses(
        anyio_backend, ray_cluster, kunserve_config, kunserve_model):
    """Instances as Ray actors (on the session's Ray, tests/cluster_fixtures.py: their node
    address, not loopback): the data plane's rendezvous is at instance 0's address on a port
    free there, the burst forms a group and restores it, and every request gives
    transformers' tokens."""
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    rng = random.Random(0)
    longs = [_prompt(rng, 8) for _ in range(2)]
    burst = [_prompt(rng, 16) for _ in range(12)]
    got: dict[str, list[int]] = {}

    async with Cluster.start(kunserve_config, kind="ray", monitor_interval_s=0.02) as cluster:
        assert cluster.groups is not None and cluster._hosts[0] != "127.0.0.1"
        with anyio.fail_after(300):
            await _long_then_burst(cluster, longs, burst, got, {})
            await cluster.wait_idle()
        report = cluster.groups.report(0.0)
    print(f"\nray: hosts {cluster._hosts}; {report}")
    assert report["groups_formed"] >= 1 and report["kv_exchanged_bytes"] > 0, report
    for name, prompt, n in [*((f"L{i}", p, LONG_TOKENS) for i, p in enumerate(longs)),
                            *((f"B{i}", p, BURST_TOKENS) for i, p in enumerate(burst))]:
        assert_matches(got[name], greedy_reference(kunserve_model, prompt, n), name)


@pytest.mark.anyio
async def test_member_lost_while_grouped_the_head_recomputes_and_serves_alone(
        anyio_backend, kunserve_config, kunserve_instances, kunserve_model):
    """Runs last: it kills one of the module's two instance processes. Killed while grouped,
    the member takes the KV of its layers with it: the head restores its dropped layers from
    its host copy, its engine recomputes every request from its tokens (the step that found the
    member gone included) and shrinks its pool back, and every request still ends with
    transformers' tokens; a new request is then served by the head alone."""
    if anyio_backend != "asyncio":
        pytest.skip("one event loop is enough: the instance processes are the expensive part")
    rng = random.Random(0)  # the first test's requests: their references are computed once
    prompts = [(_prompt(rng, 8), LONG_TOKENS) for _ in range(2)]
    prompts += [(_prompt(rng, 16), BURST_TOKENS) for _ in range(slow_scale(20, 12))]
    run = FaultBurst(prompts, errors_allowed=False)
    got = run.got

    async with Cluster.start(kunserve_config, attach=kunserve_instances,
                             monitor_interval_s=0.02) as cluster:
        with anyio.fail_after(180):
            async with anyio.create_task_group() as tg:
                group = await run.until_grouped(cluster, tg, len(prompts))
                kunserve_instances[group.members[1]].kill()
            while cluster.groups.groups:  # the monitor's next round sees the member gone
                await anyio.sleep(0.01)
            alone = _prompt(rng, 10)
            after = await cluster.complete(alone, shunter.SamplingParams(
                max_tokens=12, temperature=0))
            head = (await cluster.instances[group.head].snapshot()).scheduler
    assert head.total_blocks == SOLO_BLOCKS and head.preemptions >= 1, head
    assert not cluster.groups.groups and any(e["event"] == "lost"
                                             for e in cluster.groups.report(0.0)["events"])
    for i, (prompt, n) in enumerate(prompts):
        assert_matches(got[i], greedy_reference(kunserve_model, prompt, n), f"request {i}")
    assert_matches(after.token_ids, greedy_reference(kunserve_model, alone, 12), "after")
