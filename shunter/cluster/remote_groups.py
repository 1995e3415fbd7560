"""KunServe's drop and restore plans carried out on torch instance processes (the in-process
simulator's counterpart: shunter/cluster/groups.py `SimGroups`). The coordinator decides
(actors/coordinator.py, engine/cluster/overload.py); this sends each instance its part over
its control link (shunter/cluster/group_wire.py) and moves the client relays; the instances
do it (shunter/cluster/instance_groups.py), the tensors going over the data plane they join at
start (gpu/data_plane.py: one torch.distributed world, rank = instance index).

Forming a group: each non-head member hands its requests over (`ExportGroup`; their outputs
come from the head's link from then on, under the same cluster keys, and their cancels go
there), then the head leads (`HeadGroup`): it opens the group, adopts the requests, grows its
pool, and the KV exchange runs while it serves. Restoring: the head's pool shrinks back and its
next step restores (`LeaveGroup`); when its requests do not fit its own pool yet, the restore
waits for a later monitor round.

Queued requests of instances serving alone move to a head with room (§4.1), as the
simulator's manager does. The data plane's rendezvous is at instance 0's address (a local
process or a Ray actor; tested on one machine). A plan that merges a running group with
instances serving alone grows it, one that merges two running groups merges them
(shunter/cluster/remote_grow.py).
"""

from __future__ import annotations

import contextlib

import anyio
import structlog

from engine.cluster.counters import ClusterCounters
from engine.cluster.drop_plan import GroupPlan
from engine.cluster.messages import GroupsChanged
from engine.cluster.overload import Drop, OverloadMonitor, Restore
from engine.cluster.plan import stage_layers
from engine.errors import EngineDeadError
from shunter.cluster.group_wire import (
    AskGroupStats,
    ExportGroup,
    FreePort,
    GroupAnswer,
    HeadGroup,
    JoinDataPlane,
    LeaveGroup,
)
from shunter.cluster.remote_queues import reschedule_queued, sweep_members

log = structlog.get_logger(actor="coordinator")


class GroupCommandError(RuntimeError):
    """An instance could not carry out its part of a group change (names the instance)."""


class RemoteGroups:
    def __init__(self, instances: list, *, coordinator, base_pools, num_layers: int,
                 microbatch: str = "tokens", block_size: int = 16,
                 kv_exchange: str = "coordinated") -> None:
        self.instances = instances
        """RemoteInstance handles (shunter/cluster/handles.py), by index."""
        self.microbatch = microbatch
        """The policy's `microbatch`: how the groups formed from now on cut their steps."""
        self.kv_exchange = kv_exchange
        """The policy's `kv_exchange`: how the groups formed from now on send their KV."""
        self.block_size = block_size
        self.coordinator = coordinator
        self.base_pools = list(base_pools)
        self.num_layers = num_layers
        self.groups: dict[int, GroupPlan] = {}
        self.counters = ClusterCounters()
        self.pipelines: list[dict] = []
        """Each restored group's pipeline report (gpu/group_runner.py `pipeline_report`), as
        its head gave it once restored."""
        self.busy = False
        self._tg: anyio.abc.TaskGroup | None = None
        self.leads: list[bool] | None = None
        """Whether each instance's runner can lead a group (asked once the data plane is
        joined; None: not asked)."""
        self.cannot_grow: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        """(running group, grown members) whose split the head refused (its pool would not
        grow): not asked again every monitor round."""

    def follow(self, settings) -> None:
        """A replaced policy's memory settings: groups formed from now on use its
        `microbatch` and `kv_exchange`."""
        self.microbatch = settings.memory.microbatch
        self.kv_exchange = settings.memory.kv_exchange

    async def join(self, host: str = "127.0.0.1", timeout_s: float = 120.0) -> None:
        """Every instance joins one data plane, its rendezvous at instance 0 (`host`: the
        address the front door reaches instance 0 at), on a port free there."""
        port = await self._command(0, lambda k: FreePort(key=k))
        init = f"tcp://{host}:{port}"
        n = len(self.instances)
        with anyio.fail_after(timeout_s):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(self._command, i, lambda k, i=i: JoinDataPlane(
                        key=k, init=init, rank=i, world=n))
            self.leads = [bool((await self.stats(i)).get("can_lead")) for i in range(n)]

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            await anyio.sleep_forever()

    async def _command(self, index: int, make) -> object:
        answer: GroupAnswer = await self.instances[index]._ask(make)
        if answer.too_small:
            raise _TooSmall(answer.error)
        if answer.error is not None:
            raise GroupCommandError(f"instance {index}: {answer.error}")
        return answer.value

    async def stats(self, index: int) -> dict:
        """The instance's group counters; its count of KV moved in the groups it led is noted
        (`kv_exchanged_bytes`)."""
        value = await self._command(index, lambda k: AskGroupStats(key=k))
        if isinstance(value, dict) and value.get("kv_moved_bytes") is not None:
            self.counters.note_kv_moved(index, value["kv_moved_bytes"])
        return value

    async def instance_down(self, index: int) -> None:
        """Instance `index` went away (before its requests are ended or dispatched again). A
        lost head's group is over: each member restores its dropped layers from its host copy
        (gpu/group_member.py `serve_member` sees the head gone) and serves alone, so the
        coordinator stops sending its requests to the head now, and a request dispatched again
        can go to a member. (A lost member's group is ended by the head's engine and `act`.)"""
        g = self.groups.pop(index, None)
        if g is None:
            return
        dead = self.instances[index]
        for m in g.members[1:]:  # cancels of the requests it had handed over stay here
            moved = self.instances[m].moved_to
            for key in [k for k, to in moved.items() if to is dead]:
                del moved[key]
        self.counters.events.append({"t": anyio.current_time(), "event": "head lost",
                                     "members": list(g.members)})
        log.warning("group head lost; its members serve alone", members=g.members)
        await self.coordinator.send(GroupsChanged(restored=index))

    # ------------------------------------------------------------------ the monitor's round

    def _forget_moved(self) -> None:
        """Cancel redirects (`moved_to`) of requests that ended where they moved (a restored
        group's, and those a group that was not formed recomputed at its head)."""
        for inst in self.instances:
            for key, to in list(inst.moved_to.items()):
                if key not in to._live:
                    del inst.moved_to[key]

    async def act(self, action, stats) -> None:
        self._forget_moved()
        for h, g in list(self.groups.items()):  # a member went away: its head serves alone
            if not all(self.instances[m].alive for m in g.members):
                del self.groups[h]
                self.counters.events.append({"t": anyio.current_time(), "event": "lost",
                                             "members": list(g.members)})
                await self.coordinator.send(GroupsChanged(restored=h))
                return
        if self.busy:
            if isinstance(action, Restore):
                await self.coordinator.send(GroupsChanged())
            return
        await sweep_members(self, stats)
        if action is None and self.groups:
            await self._reschedule_queued(stats)
            return
        if isinstance(action, Drop):
            self.counters.drops += 1
            for g in action.new_groups:
                if any(set(g.members) & set(old.members) for old in self.groups.values()):
                    await self._grow(g)  # gpu/group_grow.py; else the queued requests move
                    continue
                try:
                    await self.form(g)
                except (GroupCommandError, EngineDeadError) as exc:  # an instance went away
                    log.error("group not formed", members=g.members, error=str(exc))
                    self.counters.events.append({"t": anyio.current_time(),
                                                 "event": "form failed",
                                                 "members": list(g.members),
                                                 "error": str(exc)})
                    await self.coordinator.send(GroupsChanged(restored=g.head))
            await self._reschedule_queued(stats)
        elif isinstance(action, Restore):
            self.busy = True
            self._tg.start_soon(self._restore_all, action.heads)

    async def _grow(self, g: GroupPlan) -> None:
        """A plan that merges a running group with instances serving alone grows it, one that
        merges two running groups (and instances alone) merges them
        (shunter/cluster/remote_grow.py); any other plan with a running group is refused."""
        from shunter.cluster.remote_grow import CannotGrow, Postponed, grow, grows, merge, merges

        old, joins = grows(self.groups, g), None
        if old is None and (pair := merges(self.groups, g)) is not None:
            old, joins = pair
        event = {"t": anyio.current_time(), "members": list(g.members)}
        key = None if old is None else (old.members, tuple(sorted(g.members)))
        if old is None or key in self.cannot_grow or (
                self.leads is not None and not self.leads[old.head]):
            self.counters.events.append({**event, "event": "grow refused"})
            return
        try:
            await (grow(self, old, g) if joins is None else merge(self, old, joins, g))
        except CannotGrow as exc:
            self.cannot_grow.add(key)
            log.info("group cannot grow", members=g.members, why=str(exc))
            self.counters.events.append({**event, "event": "grow refused", "error": str(exc)})
        except Postponed as exc:
            self.counters.events.append({**event, "event": "merge postponed",
                                         "error": str(exc)})
        except (GroupCommandError, EngineDeadError) as exc:
            log.error("group did not grow", members=g.members, error=str(exc))
            self.counters.events.append({**event, "event": "grow failed", "error": str(exc)})

    async def form(self, g: GroupPlan) -> None:
        """Each member hands its requests over, then the head leads. A member that cannot
        (gone, or refusing) after others did: the head is told the group will not form
        (`HeadGroup.not_formed`), recomputes the requests handed over and lets those members
        go; the error is raised."""
        for m in g.members[1:]:
            if any(m in old.members for old in self.groups.values()):
                raise GroupCommandError(f"instance {m} is in a group already; growing a running "
                                        f"group is not done on torch instances")
        if self.leads is not None and not self.leads[g.head]:  # before any member exports
            raise GroupCommandError(f"instance {g.head}: its runner cannot lead KunServe "
                                    f"pipeline groups (the torch backend's KunServeTorchRunner "
                                    f"can); group {g.members} not formed, nothing moved")
        adopted, exported = [], []
        for k, m in enumerate(g.members[1:], start=1):
            try:
                adopted += [(k, mv) for mv in await self._export(g.head, m)]
            except (GroupCommandError, EngineDeadError) as exc:
                if exported:
                    await self._give_up(g, adopted, exported, f"instance {m} could not join "
                                        f"({exc})")
                raise
            exported.append(m)
        counts = await self._command(g.head, lambda key: HeadGroup(
            key=key, plan=g, adopted=tuple(adopted), microbatch=self.microbatch,
            kv_exchange=self.kv_exchange))
        self.groups[g.head] = g
        await self.coordinator.send(GroupsChanged(formed=g))
        c = self.counters
        c.groups_formed += 1
        c.adopted_requests += len(adopted)
        c.events.append({"t": anyio.current_time(), "event": "group",
                         "members": list(g.members), **counts})
        log.info("group formed", members=g.members, **counts)
        await self.note_kv(g.head)

    async def note_kv(self, head: int) -> None:
        """Reads the head's count of KV moved (`stats` notes it); one gone keeps its last."""
        with contextlib.suppress(GroupCommandError, EngineDeadError):
            await self.stats(head)

    async def _export(self, head: int, m: int) -> tuple:
        """Member `m` hands its requests over to `head`; their outputs come from the head's
        link from now on (and their cancels go there)."""
        moved = await self._command(m, lambda key: ExportGroup(key=key, head=head))
        member, to = self.instances[m], self.instances[head]
        for mv in moved:
            live = member._live.pop(mv.cluster_key, None)
            if live is not None:
                to._live[mv.cluster_key] = live
                member.moved_to[mv.cluster_key] = to
        return moved

    async def _give_up(self, g: GroupPlan, adopted, exported, why: str) -> None:
        """The group will not form after `exported` members handed `adopted` over: the head
        recomputes those requests and tells those members to serve alone. (A head gone: its
        link's end settles the requests; the members see it gone.)"""
        log.error("group not formed; the requests handed over go to its head", why=why,
                  members=g.members)
        try:
            await self._command(g.head, lambda key: HeadGroup(
                key=key, plan=g, adopted=tuple(adopted), not_formed=why,
                exported=tuple(exported)))
        except (GroupCommandError, EngineDeadError) as exc:
            log.error("the head could not take them", head=g.head, error=str(exc))

    async def _reschedule_queued(self, stats) -> None:
        await reschedule_queued(self, stats)  # (shunter/cluster/remote_queues.py)

    async def _restore_all(self, heads) -> None:
        try:
            for h in heads:
                if h in self.groups:
                    await self.restore(h)
        finally:
            self.busy = False

    async def restore(self, head: int) -> bool:
        """False when the head's requests do not fit its own pool yet (asked again later)."""
        g = self.groups[head]
        try:
            value = await self._command(head, lambda key: LeaveGroup(key=key))
        except _TooSmall as exc:
            self.counters.restore_retries += 1
            log.info("restore postponed", head=head, why=str(exc))
            await self.coordinator.send(GroupsChanged())  # keep the restore trigger armed
            return False
        except (GroupCommandError, EngineDeadError) as exc:
            log.error("restore failed", head=head, error=str(exc))
            await self.coordinator.send(GroupsChanged())
            return False
        if self.groups.pop(head, None) is None:  # `act` ended it: a member went away as it left
            return True
        self._forget_moved()  # members', and instances' whose queued requests moved
        await self.coordinator.send(GroupsChanged(restored=head))
        self.counters.restores += 1
        self.counters.events.append({"t": anyio.current_time(), "event": "restore",
                                     "members": list(g.members), **value})
        log.info("group restored", members=g.members)
        try:  # its next step restores (the KV it receives then is counted: stats notes it)
            with anyio.move_on_after(30):
                while (head_stats := (await self.stats(head))["head"])["leading"]:
                    await anyio.sleep(0.005)
        except (GroupCommandError, EngineDeadError) as exc:
            log.warning("no group stats", head=head, error=str(exc))
        else:
            if head_stats["leading"]:
                log.warning("not restored yet; its KV is counted later", head=head)
            self.pipelines.append(dict(head_stats["pipeline"], stages=len(g.members)))
        return True

    def report(self, t0: float) -> dict:
        """The bench JSON's `cluster` block: the counters, and over the restored groups the
        bubble ratio of their replayed schedules and Eq. 1-3's held-out error."""
        p = self.pipelines
        busy = sum(x["busy_s"] for x in p)
        span = sum(x["stages"] * x["makespan_s"] for x in p)
        errors = [x["cost_model"]["error"] for x in p if x["cost_model"]["error"]["n"]]
        tok = [x["cost_model"]["tokens_model_error"] for x in p
               if x["cost_model"]["tokens_model_error"]["n"]]

        def mean(stats: list[dict]) -> float | None:
            n = sum(e["n"] for e in stats)
            return sum(e["mean"] * e["n"] for e in stats) / n if n else None

        return {**self.counters.block(t0), "bubble_ratio": 1 - busy / span if span else None,
                "microbatch": self.microbatch, "pipeline_steps": sum(x["steps"] for x in p),
                "cost_model_error": mean(errors), "token_model_error": mean(tok)}


class _TooSmall(Exception):
    pass


def torch_overload_monitor(policy, config, runner, count: int) -> OverloadMonitor | None:
    """KunServe's global monitor for a cluster of `count` torch instance processes built from
    `config` (`runner`: the front door's unstarted TorchRunner, for the model's facts), when
    the policy has `overload` triggers and the runner can lead groups; else None. The planner
    sizes every group as torch will (gpu/stage_view.py `group_pool_blocks` of the split
    `stage_layers` gives it: an uneven group gets its smallest stage's capacity, short of the
    linear count); `weight_blocks` (a two-way group's pool less the two members' own) is kept
    for the monitor's other uses."""
    from gpu.arena import plan_layout
    from gpu.stage_view import group_pool_blocks
    from shunter.cluster.groups import policy_triggers

    if runner is None or not hasattr(runner, "form") or count < 2:
        return None
    triggers = policy_triggers(policy)
    if triggers is None:
        return None
    model = runner._model_config
    layers = model.num_layers
    bs, dtype = config.block_size, runner._dtype
    base = runner.num_blocks
    total = plan_layout(model, bs, dtype).weight_blocks + base
    half = layers // 2
    pair = group_pool_blocks(model, bs, dtype, total, (range(half), range(half, layers)))
    sizes: dict[int, int] = {}

    def pool(pools) -> int:  # every member's pool is `base`: the group's size decides
        if len(pools) not in sizes:
            sizes[len(pools)] = group_pool_blocks(model, bs, dtype, total,
                                                  stage_layers(layers, len(pools)))
        return sizes[len(pools)]

    return OverloadMonitor(base_pools=[base] * count, block_size=bs, num_layers=layers,
                           weight_blocks=max(0, pair - 2 * base), triggers=triggers, pool=pool)
