"""A cluster: N instances behind the coordinator actor, with the Engine's client API.

    async with Cluster.start(EngineConfig(), instances=2) as cluster:
        async for chunk in cluster.generate("def fib(n):", SamplingParams(max_tokens=32)):
            ...

Each request asks the coordinator (actors/coordinator.py) for an instance by the policy's
`dispatch` rule, then goes to that instance's handle (shunter/cluster/handles.py). A monitor
task reads every instance's snapshot every `monitor_interval_s` and reports it to the
coordinator. An instance that dies is marked down: requests it had not streamed from are
dispatched again, the rest end with an error naming the instance, and new requests go to the
others.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Literal

import anyio
import attrs

from actors.coordinator import Coordinator
from engine.cluster.dispatch import DISPATCH_RULES, DispatchTable, InstanceView, NoInstanceError
from engine.cluster.messages import (
    CheckOverload,
    ChooseInstance,
    CoordinatorMessage,
    InspectCluster,
    InstanceDown,
    RequestEnded,
    SetDispatchRule,
    SetTriggers,
    StatsReported,
)
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.messages import Submit
from engine.outputs import Rejected
from engine.params import SamplingParams, SchedulingParams
from engine.policy import EngineCapabilities, Policy
from engine.reply import Reply
from engine.snapshots import EngineSnapshot
from shunter.backends import Backend, build_backend
from shunter.client import Completion, GenerationStream, collect
from shunter.cluster.groups import SimGroups, overload_monitor, policy_triggers
from shunter.cluster.handles import RemoteInstance, refusal, tell
from shunter.cluster.heartbeat import Liveness
from shunter.cluster.inprocess import InProcessInstance
from shunter.cluster.launch import (Attached, Launched, Launcher, LocalLauncher, RayLauncher,
                                   current_backend)
from shunter.cluster.remote_groups import RemoteGroups, torch_overload_monitor
from shunter.cluster.wire import Hello, Link
from shunter.engine import Engine
from shunter.policy_source import engine_capabilities, initial_policy, replacement
from sim.network import LINKS

ClusterKind = Literal["local", "ray", "inprocess"]

INPROCESS_TORCH_NO_GROUPS = (
    "KunServe's pipeline groups form over torch instance processes (kind='local' or 'ray': each "
    "joins the cluster's data plane); torch engines in one process would never drop a layer. "
    "Start the cluster with kind='local', or use a policy without `overload` rules")


@attrs.frozen(kw_only=True)
class ClusterSnapshot:
    """Every instance's state: the coordinator's view and, for live ones, its engine's snapshot."""

    views: tuple[InstanceView, ...]
    snapshots: tuple[EngineSnapshot | None, ...]
    failures: tuple[str | None, ...]

    @property
    def idle(self) -> bool:
        return all(s is None or s.idle for s in self.snapshots) and not any(
            v.in_flight for v in self.views)


class Cluster:
    def __init__(self, config: EngineConfig, policy: Policy, count: int,
                 monitor_interval_s: float, backend: Backend,
                 capabilities: EngineCapabilities) -> None:
        self.config = config
        self.policy = policy
        self.policy_version = 1
        self.backend = backend
        """The model's facts the front door needs (tokenizer, context, vocabulary); its runner
        is never started here: the instances run the model."""
        self.capabilities = capabilities
        self.instances: list[RemoteInstance | InProcessInstance] = []
        self.table = DispatchTable(count, config.block_size)
        self._count = count
        self._monitor_interval_s = monitor_interval_s
        self.liveness = Liveness()
        self._keys = itertools.count(1)
        self._where: dict[int, tuple[int, int]] = {}
        """Cluster request id -> (instance, demand tokens)."""
        self._coordinator = None
        self._closed = False
        self._hosts: list[str] = []
        """Where each instance process listens (the data plane's rendezvous is instance 0's)."""
        self.groups = None
        """KunServe's groups on in-process sim instances (shunter/cluster/groups.py)."""

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, config: EngineConfig | None = None, *, instances: int = 2,
                    kind: ClusterKind = "local", monitor_interval_s: float = 0.05,
                    async_backend: str | None = None, attach: Sequence[Launched] = (),
                    liveness: Liveness | None = None) -> AsyncIterator[Cluster]:
        """Start `instances` engines from `config` (each the same model and policy), the
        coordinator and the monitor; stop them all when the block exits. With `attach`, use
        those running instances instead (started by `LocalLauncher.start_process`, all from
        `config`) and leave them running. `liveness`: how an instance process that went silent
        is found (shunter/cluster/heartbeat.py; default `Liveness()`)."""
        config = config or EngineConfig()
        backend = build_backend(config)
        capabilities = engine_capabilities(config, backend)
        close_runner = getattr(backend.runner, "close", None)
        if close_runner is not None:
            close_runner()  # built for its facts only (a TorchRunner has a device thread)
        if kind == "inprocess" and not attach and hasattr(backend.runner, "form"):
            capabilities = attrs.evolve(capabilities, no_overload=INPROCESS_TORCH_NO_GROUPS)
        policy = initial_policy(config, None, capabilities)
        cluster = cls(config, policy, len(attach) or instances, monitor_interval_s,
                      attrs.evolve(backend, runner=None), capabilities.running(policy.settings))
        cluster.liveness = liveness or Liveness()
        launcher: Launcher | None = None
        if attach:
            launcher = Attached(attach)
        elif kind == "local":
            launcher = LocalLauncher(async_backend or current_backend())
        elif kind == "ray":
            launcher = RayLauncher(num_gpus=1.0 if config.device.startswith("cuda") else 0.0)
        send, recv = anyio.create_memory_object_stream[CoordinatorMessage](math.inf)
        cluster._coordinator = send
        try:
            async with contextlib.AsyncExitStack() as stack:
                # in-process engines first: their task groups must enclose this one
                engines = [] if launcher is not None else [
                    await stack.enter_async_context(Engine.start(config, policy=policy))
                    for _ in range(cluster._count)]
                async with anyio.create_task_group() as tg:
                    overload = overload_monitor(policy, config, engines)
                    if overload is None and launcher is not None:  # torch instance processes
                        overload = torch_overload_monitor(policy, config, backend.runner,
                                                          cluster._count)
                    await tg.start(cluster._run_coordinator, Coordinator(
                        table=cluster.table, rule=DISPATCH_RULES[policy.settings.dispatch],
                        inbox=recv, overload=overload), recv)
                    if launcher is None:
                        await cluster._start_in_process(engines, tg)
                    else:
                        await cluster._start_remote(launcher, tg)
                    if overload is not None and launcher is not None:  # torch processes
                        cluster.groups = RemoteGroups(
                            cluster.instances, coordinator=send, base_pools=overload.base_pools,
                            num_layers=overload.num_layers, block_size=config.block_size,
                            microbatch=policy.settings.memory.microbatch,
                            kv_exchange=policy.settings.memory.kv_exchange)
                        await cluster.groups.join(host=cluster._hosts[0])
                        await tg.start(cluster.groups.run)
                    elif overload is not None:
                        cluster.groups = SimGroups(
                            cluster.instances, model=engines[0].backend.runner._model,
                            link=LINKS[config.pipeline_link], block_size=config.block_size,
                            memory=policy.settings.memory, coordinator=send)
                        cluster.groups.monitor = overload  # its plan counts, for the report
                        await tg.start(cluster.groups.run)
                    tg.start_soon(cluster._monitor)
                    try:
                        yield cluster
                    finally:
                        await cluster._close_instances(detach=bool(attach))
                        tg.cancel_scope.cancel()
        finally:
            if launcher is not None:
                await anyio.to_thread.run_sync(launcher.shutdown)

    async def _run_coordinator(self, coordinator: Coordinator, inbox, *,
                               task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED
                               ) -> None:
        """The coordinator actor; once it stops, questions left or later sent fail, so that no
        dispatch (shielded from its client's cancellation) waits for an answer for ever."""
        try:
            await coordinator.run(task_status=task_status)
        finally:
            while True:
                try:
                    msg = inbox.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
                if isinstance(getattr(msg, "reply", None), Reply):
                    msg.reply.fail(EngineDeadError(self.stopped_reason()))
            inbox.close()

    async def _start_remote(self, launcher: Launcher, tg: anyio.abc.TaskGroup) -> None:
        launched = [None] * self._count

        async def one(i: int) -> None:
            launched[i] = await launcher.launch(i, self.config)

        async with anyio.create_task_group() as starting:
            for i in range(self._count):
                starting.start_soon(one, i)
        self._hosts = [up.host for up in launched]
        for i, up in enumerate(launched):
            stream = await anyio.connect_tcp(up.host, up.port)
            link = Link(stream)
            hello: Hello = await link.receive()
            handle = RemoteInstance(i, link, on_end=self._ended, redispatch=self._redispatch,
                                    on_down=self._instance_down, describe_death=up.describe_death,
                                    kill=up.kill, pid=hello.pid, liveness=self.liveness)
            self.instances.append(handle)
            tg.start_soon(handle.run)

    async def _start_in_process(self, engines: list[Engine], tg: anyio.abc.TaskGroup) -> None:
        for i, engine in enumerate(engines):
            handle = InProcessInstance(i, engine, on_end=self._ended, redispatch=self._redispatch,
                                       on_down=self._instance_down)
            self.instances.append(handle)
            await tg.start(handle.run)

    async def _instance_down(self, index: int, reason: str) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._coordinator.send(InstanceDown(instance=index, reason=reason))
        if getattr(self.instances[index], "went_silent", False):  # no peer saw its links close
            for other in self.instances:
                if other.alive and other.index != index:
                    await other.peer_lost(index)
        lost = getattr(self.groups, "instance_down", None)
        if lost is not None:  # torch groups: a lost head's members serve alone from now on
            await lost(index)

    async def _monitor(self) -> None:
        """Every instance's stats to the coordinator (KunServe's global monitor reads these)."""
        while not self._closed:
            await self._monitor_round()
            await anyio.sleep(self._monitor_interval_s)

    async def _monitor_round(self) -> None:
        for inst in self.instances:
            if not inst.alive or self._closed:
                continue
            try:
                stats = await inst.stats()
            except EngineDeadError as exc:
                if not self._closed:
                    await inst.mark_down(f"instance {inst.index}: {exc}")
                continue
            await self._coordinator.send(StatsReported(instance=inst.index, stats=stats))
        if self.groups is not None and not self._closed:  # KunServe's global monitor
            reply = Reply[object]()
            await self._coordinator.send(CheckOverload(reply=reply))
            await self.groups.act(await reply.wait(),
                                  [self.table.stats(i) for i in range(self._count)])

    # ------------------------------------------------------------------ the Engine's client API

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 scheduling: SchedulingParams | None = None) -> GenerationStream:
        return GenerationStream(self, prompt, params or SamplingParams(),
                                scheduling or SchedulingParams())

    async def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       *, scheduling: SchedulingParams | None = None) -> Completion:
        return await collect(GenerationStream(self, prompt, params or SamplingParams(),
                                              scheduling or SchedulingParams(), stream=False))

    async def _submit(self, msg: Submit, key: int | None = None, announced: bool = False,
                      since: float | None = None) -> None:
        if self._closed:
            raise EngineDeadError(self.stopped_reason())
        key = key or next(self._keys)
        prompt = len(msg.prompt_ids) if msg.prompt_ids is not None else len(msg.prompt or "")
        demand = prompt + msg.sampling.max_tokens
        # shielded from the client's cancellation (an HTTP client hanging up), so that what the
        # coordinator counts ends; the handle, finding the client gone, cancels the request
        with anyio.CancelScope(shield=True):
            try:
                index = await self._choose(demand)
            except NoInstanceError as exc:
                await tell(msg.outputs, refusal(key, Rejected(error=EngineDeadError(str(exc))),
                                                announced=announced))
                return
            except EngineDeadError:  # the cluster stopped before it chose: the client is told
                msg.outputs.close()
                return
            self._where[key] = (index, demand)
            if self._closed:  # it shut down during the round trip: it ends as the live did
                self._ended(key)
                msg.outputs.close()
                return
            await self.instances[index].submit(key, msg, announced=announced, since=since)

    async def _choose(self, demand: int) -> int:
        """The coordinator's pick for a request of `demand` tokens (one round trip)."""
        reply = Reply[int]()
        try:
            await self._coordinator.send(ChooseInstance(demand_tokens=demand, reply=reply))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise EngineDeadError(self.stopped_reason()) from None
        return await reply.wait()

    async def _redispatch(self, key: int, msg: Submit, announced: bool, since: float) -> None:
        """A request its dead instance had not streamed from: serve it elsewhere, under the id
        its client has or will be told (`announced`: whether the dead instance's `Admitted`
        reached the client; if not, the new instance's does). Not if its client has gone, nor
        once the cluster shuts down (its stream ends, as every live request's does then)."""
        if msg.outputs.statistics().open_receive_streams == 0:
            return
        if self._closed:
            return msg.outputs.close()
        await self._submit(msg, key=key, announced=announced, since=since)

    async def _close_instances(self, *, detach: bool) -> None:
        """Refuse new requests, stop (or detach from) every instance, end what is live."""
        self._closed = True
        for inst in self.instances:
            await inst.close(detach=detach)

    def _ended(self, key: int) -> None:
        where = self._where.pop(key, None)
        if where is not None:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._coordinator.send_nowait(RequestEnded(instance=where[0],
                                                           demand_tokens=where[1]))

    def _cancel_nowait(self, request_id: int) -> None:
        where = self._where.get(request_id)
        if where is not None:
            self.instances[where[0]].cancel_nowait(request_id)

    def stopped_reason(self) -> str:
        return "the cluster shut down" if self._closed else "the cluster stopped"

    async def inspect(self) -> ClusterSnapshot:
        reply = Reply[tuple[InstanceView, ...]]()
        await self._coordinator.send(InspectCluster(reply=reply))
        views = await reply.wait()
        snaps: list[EngineSnapshot | None] = []
        for inst in self.instances:
            try:
                snaps.append(await inst.snapshot() if inst.alive else None)
            except EngineDeadError:
                snaps.append(None)
        return ClusterSnapshot(views=views, snapshots=tuple(snaps),
                               failures=tuple(i.failure for i in self.instances))

    async def wait_idle(self, poll_s: float = 0.01) -> ClusterSnapshot:
        while not (snap := await self.inspect()).idle:
            await anyio.sleep(poll_s)
        return snap

    async def replace_policy(self, policy: Policy | str, *, base_dir: Path | None = None) -> Policy:
        """Compile `policy` here (errors point into it, the running one stays), then send its
        text to every live instance, each of which compiles and runs it from its next
        iteration; the coordinator dispatches by its `dispatch` rule from now on. An instance
        found down meanwhile is marked down and skipped (it serves nothing more)."""
        new = replacement(policy, self.policy, self.capabilities, base_dir)
        for inst in self.instances:
            if not inst.alive:
                continue
            try:
                await inst.replace_policy(new.source)
            except EngineDeadError as exc:
                await inst.mark_down(str(exc))
        await self._coordinator.send(SetDispatchRule(rule=DISPATCH_RULES[new.settings.dispatch]))
        if self.groups is not None:  # KunServe: the monitor's triggers follow the policy
            await self._coordinator.send(SetTriggers(triggers=policy_triggers(new)))
            getattr(self.groups, "follow", lambda settings: None)(new.settings)
        self.policy, self.policy_version = new, self.policy_version + 1
        return new

    @property
    def failure(self) -> str | None:
        """Why the cluster cannot serve: it shut down, or every instance is down."""
        if self._closed:
            return self.stopped_reason()
        if self.instances and not any(i.alive for i in self.instances):
            return "every instance of the cluster is down: " + "; ".join(
                i.failure or "" for i in self.instances)
        return None
