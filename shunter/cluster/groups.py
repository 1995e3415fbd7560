"""KunServe's drop and restore plans carried out on a cluster's in-process instances (the
simulator's N engines on one virtual clock): the coordinator decides (actors/coordinator.py,
engine/cluster/overload.py), this does it, talking to each engine's actors by their inboxes.

Forming a group (§4.1-4.2): each member that served alone hands its requests over (their state
and their client streams, engine/cluster/adoption.py); the head adopts them, grows its pool by
torch's group pool (sim/arena_layout.py `sized_pool`; the monitor plans with the same count),
and from its next step runs as a pipeline over the group (sim/group.py). The KV of every request
in flight for the layers another member now keeps is exchanged over each source's link, in
whole blocks (sim_formation.py, sim/exchange.py); each request waits for its own bytes. New
requests for a member go to the head. Restoring (§4.4), once the exchange has settled: the
members pull their dropped layers back and the head the KV of the layers it had dropped, while
the group goes on serving or at one step, from peers or each member's host copy, as the
policy's `restore_prefetch` / `restore_from` say (sim_restore.py); then the head's pool shrinks
back (only once its requests fit) and every member serves alone again, the non-head ones with
empty pools.
The torch instances do the same through K2's wire commands (see the engine API note).
"""

from __future__ import annotations

import anyio
import structlog

from engine.cluster.counters import ClusterCounters
from engine.cluster.drop_plan import GroupPlan, queue_moves
from engine.cluster.messages import GroupsChanged
from engine.cluster.overload import Drop, OverloadMonitor, Restore, Trigger, TriggerFactory
from engine.messages import HandOverStreams, Regroup, TakeOverStreams
from engine.policy import MemorySettings
from engine.reply import Reply
from shunter.cluster.sim_faults import recover
from shunter.cluster.sim_formation import Formation, exchange, merge_load_s
from sim.arena_layout import freed_blocks, planned_pool, sized_pool
from shunter.cluster.sim_restore import OneStep, restore
from sim.group import GroupNetwork
from sim.network import NetworkLink
from sim.profile import ModelShape

log = structlog.get_logger(actor="coordinator")


class SimGroups:
    def __init__(self, instances: list, *, model: ModelShape, link: NetworkLink,
                 block_size: int, memory: MemorySettings, coordinator) -> None:
        self.instances = instances
        """InProcessInstance handles (shunter/cluster/handles.py), by index."""
        self.model = model
        self.link = link
        self.coordinated = memory.kv_exchange == "coordinated"
        self.restore_prefetch = memory.restore_prefetch
        self.restore_from = memory.restore_from
        self.coordinator = coordinator
        self.base_pools = [i.engine.backend.runner.num_blocks for i in instances]
        copy = getattr(instances[0].engine.backend.runner._link, "bandwidth_gb_per_s", 32.0)
        self.host_bytes_per_s = copy * 1e9
        """Where a member's dropped layers come back from after a fault: its host copy, over
        the profile's host link (32 GB/s, PCIe 4.0 x16, when the profile names none)."""
        self.block_size = block_size
        self.block_bytes = model.block_bytes(block_size)
        self.groups: dict[int, GroupPlan] = {}
        self.faults: dict[int, int] = {}
        """Groups dissolved by a fault, by head (their KV exchanges no longer report)."""
        self.monitor: OverloadMonitor | None = None
        """The coordinator's monitor (read for its plan counts in the report)."""
        self.reloading: set[int] = set()
        """Members of groups a fault dissolved, until their layers are back (sim_faults.py)."""
        self.one_step: dict[int, OneStep] = {}
        """Heads in a one-step restore, until its copies land (sim_restore.py `OneStep`)."""
        self.exchanging: dict[int, Formation] = {}
        """Each head's last formation exchange: the requests whose KV has not arrived (a
        restore waits for them, sim_formation.py `settled`)."""
        self.prefetching: dict[int, anyio.CancelScope] = {}
        """Heads whose restore prefetch runs: cancelled when a member is lost (sim_restore.py)."""
        self.counters = ClusterCounters()
        self.swept: list[dict] = []  # `_sweep_members`' moves (not `events`: groups' lives)
        self.busy = False
        self._tg: anyio.abc.TaskGroup | None = None
        for inst in instances:
            inst.engine.backend.runner.network = GroupNetwork(
                link=link, model=model, microbatch=memory.microbatch, block_size=block_size)

    def follow(self, settings) -> None:
        """A replaced policy's memory settings: exchanges and groups formed from now on use
        its `kv_exchange`, `microbatch`, `restore_prefetch` and `restore_from`."""
        self.coordinated = settings.memory.kv_exchange == "coordinated"
        self.restore_prefetch = settings.memory.restore_prefetch
        self.restore_from = settings.memory.restore_from
        for net in self.networks():
            net.microbatch = settings.memory.microbatch

    def networks(self) -> list[GroupNetwork]:
        return [i.engine.backend.runner.network for i in self.instances]

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            await anyio.sleep_forever()

    # ------------------------------------------------------------------ the monitor's round

    async def act(self, action, stats) -> None:
        self._sample(stats)
        for head, g in list(self.groups.items()):  # §4.4: a member lost while grouped
            lost = [m for m in g.members if not self.instances[m].alive]
            if lost:
                del self.groups[head]
                self.faults[head] = self.faults.get(head, 0) + 1
                self.reloading.update(g.members)  # until recover's GroupsChanged(restored)
                log.warning("group member lost", members=g.members, lost=lost)
                if (prefetch := self.prefetching.pop(head, None)) is not None:
                    prefetch.cancel()  # its copies to and from the lost member end with it
                self._tg.start_soon(recover, self, g, lost, _ask)
        if not self.busy:
            await self._sweep_members(stats)
        if self.busy:  # a restore under way: a restore asked for now waits for the next round
            if isinstance(action, Restore):
                await self.coordinator.send(GroupsChanged())
            return
        if action is None and self.groups and not self.busy:
            await self._reschedule_queued(stats)
            return
        if isinstance(action, Drop) and self._reloading_in(action):
            return  # planned on a group a fault dissolved this round: planned again next round
        if isinstance(action, Drop):
            self.counters.drops += 1
            for g in action.new_groups:
                await self._form(g)
            await self._reschedule_queued(stats)
        elif isinstance(action, Restore):
            self.busy = True
            self._tg.start_soon(self._restore_all, action.heads)

    def _reloading_in(self, action: Drop) -> bool:
        """A drop that would group an instance lost or still reloading its layers after a fault
        (the monitor leaves those out once it knows of the loss; this covers a plan made in the
        round the loss was seen): refused and counted."""
        bad = sorted({m for g in action.new_groups for m in g.members
                      if m in self.reloading or not self.instances[m].alive})
        if bad:
            self.counters.refused_drops += 1
            log.warning("drop refused: instances reloading after a fault", instances=bad)
        return bool(bad)

    def _sample(self, stats) -> None:
        member = {m: h for h, g in self.groups.items() for m in g.members[1:]}
        self.counters.timeline.append({
            "t": anyio.current_time(),
            "used": [None if s is None or i in member else s.total_blocks - s.free_blocks
                     for i, s in enumerate(stats)],
            "pool": [0 if i in member else (s.total_blocks if s else 0)
                     for i, s in enumerate(stats)],
            "group": [member.get(i, i) for i in range(len(stats))],
            "dropped_layers": [self._dropped(i) for i in range(len(stats))],
            "queued_tokens": sum(s.queued_tokens for s in stats if s is not None),
            "demand": None if self.monitor is None else self.monitor.cluster_load(
                stats, [x.alive for x in self.instances]).kv_usage})  # what restore reads

    def _dropped(self, index: int) -> int:
        """Layers `index` has dropped (0 alone)."""
        for g in self.groups.values():
            if index in g.members:
                return self.model.num_layers - len(g.layers[g.members.index(index)])
        return 0

    # ------------------------------------------------------------------ forming a group

    async def _form(self, g: GroupPlan) -> None:
        began = anyio.current_time()
        head = self.instances[g.head].engine
        members = {m: h for h, old in self.groups.items() for m in old.members[1:]}
        before = {m: r for old in self.groups.values() for m, r in zip(old.members, old.layers)}
        merge = sum(1 for old in self.groups.values() if set(old.members) & set(g.members)) > 1
        sources: dict[int, int] = {}
        adopted = []
        for m in g.members[1:]:
            if m in members:
                continue  # already a member: its requests are the head's
            eng = self.instances[m].engine
            was_head = m in self.groups
            reqs = await _ask(eng._scheduler_send, lambda r, was_head=was_head, m=m: Regroup(
                export=True, reply=r, pool_blocks=self.base_pools[m] if was_head else None,
                group=GroupPlan(group_id=-1, members=(m,), layers=(range(self.model.num_layers),))
                if was_head else None))
            if not reqs:
                continue
            streams = await _ask(eng._frontend_send, lambda r, reqs=reqs: HandOverStreams(
                request_ids=tuple(q.id for q in reqs), reply=r))
            new_ids = await _ask(head._frontend_send,
                                 lambda r, streams=streams: TakeOverStreams(streams=streams, reply=r))
            self._move_cancels(m, g.head, new_ids)
            for q in reqs:
                q.id = new_ids[q.id]
                sources[q.id] = m
            adopted += reqs
        own = (await head.inspect()).scheduler.live_requests
        pool = self.pool_of(g)
        waiting = await _ask(head._scheduler_send, lambda r: Regroup(
            adopt=tuple(adopted), exchange=own, pool_blocks=pool, group=g, reply=r))
        self.groups = {h: old for h, old in self.groups.items()
                       if not set(old.members) & set(g.members)}
        self.groups[g.head] = g
        load_s = merge_load_s(self, g, before, merge)
        head.backend.runner.network.loaded_at = anyio.current_time() + load_s
        await self.coordinator.send(GroupsChanged(formed=g))
        self._exchange(g, waiting, sources)
        c = self.counters
        c.groups_formed += 1
        c.adopted_requests += len(adopted)
        c.events.append({"t": anyio.current_time(), "event": "group", "members": list(g.members),
                         "pool_blocks": pool, "adopted": len(adopted), "exchanging": len(waiting),
                         "forming_s": anyio.current_time() - began, "load_s": load_s})
        log.info("group formed", members=g.members, pool_blocks=pool, adopted=len(adopted),
                 exchanging=len(waiting))

    async def _sweep_members(self, stats) -> None:
        """A request dispatched to a member while its group formed (after the member handed
        its requests over, before the coordinator redirected it) goes to the head and is
        prefilled again there (`Regroup.adopt_recompute`): a member serves nothing alone, its
        layers being dropped. Each monitor round, for the members whose stats show requests;
        each move is noted in `swept`."""
        for head, g in list(self.groups.items()):
            for m in g.members[1:]:
                s = stats[m] if m < len(stats) else None
                if s is None or not (s.running or s.waiting) or not self.instances[m].alive:
                    continue
                late = await self._move(m, head, queued_only=False)
                if late:
                    await _ask(self.instances[head].engine._scheduler_send, lambda r, late=late:
                               Regroup(adopt=tuple(late), adopt_recompute=True, reply=r))
                    self.swept.append({"t": anyio.current_time(), "member": m, "head": head,
                                       "requests": len(late)})
                    log.warning("requests on a group member moved to its head", member=m,
                                head=head, requests=len(late))

    def pool_of(self, g: GroupPlan) -> int:
        """The KV blocks `g`'s head gets: torch's group pool (sim/arena_layout.py `sized_pool`:
        an uneven split wastes what its stride leaves over), as the monitor planned it."""
        return sized_pool(self.model, self.block_size, [self.base_pools[m] for m in g.members],
                          g.layers)

    async def _reschedule_queued(self, stats) -> None:
        """Queued requests (no KV yet) of an instance serving alone whose demand exceeds its
        free memory go to the group head with the most free blocks, if it can hold them and
        has no queue of its own (engine/cluster/drop_plan.py `queue_moves`). A move takes no
        time (engine/cluster/adoption.py `queue_only`). Into a head that queues, the moves
        relieved the instance's memory every round, so its drop trigger never held: on
        azure-conv 1x the second group never formed and the head queued the burst on compute
        (kunserve P99 TTFT 2.10 s; 1.62 s with this rule)."""
        for i, best in queue_moves(
                stats, block_size=self.instances[0].engine.config.block_size,
                grouped={m for g in self.groups.values() for m in g.members},
                heads=list(self.groups), alive=[inst.alive for inst in self.instances]):
            moved = await self._move(i, best, queued_only=True)
            self.counters.rescheduled_requests += len(moved)

    async def _move(self, src: int, head: int, *, queued_only: bool) -> list:
        """Requests of `src` (all, or only its queued ones) and their client streams, to the
        head's engine under new ids; returns them (not yet adopted)."""
        eng, to = self.instances[src].engine, self.instances[head].engine
        reqs = await _ask(eng._scheduler_send, lambda r: Regroup(
            export=not queued_only, export_queued=queued_only, reply=r))
        if not reqs:
            return []
        streams = await _ask(eng._frontend_send, lambda r: HandOverStreams(
            request_ids=tuple(q.id for q in reqs), reply=r))
        new_ids = await _ask(to._frontend_send,
                             lambda r: TakeOverStreams(streams=streams, reply=r))
        self._move_cancels(src, head, new_ids)
        for q in reqs:
            q.id = new_ids[q.id]
        if queued_only:
            await _ask(to._scheduler_send, lambda r: Regroup(adopt=tuple(reqs), reply=r))
        return list(reqs)

    def _move_cancels(self, src: int, head: int, new_ids: dict[int, int]) -> None:
        """Cancels of the moved requests go to the head's engine from now on (their outputs
        still reach the clients through the source handle's relay, which holds their streams)."""
        a, b = self.instances[src], self.instances[head]
        for key, rid in list(a._ids.items()):
            if rid in new_ids:
                a._cancel_to[key] = (b.engine, new_ids[rid])

    def _exchange(self, g: GroupPlan, waiting, sources: dict[int, int]) -> None:
        """Every waiting request's KV for the layers other members keep (sim_formation.py)."""
        exchange(self, g, waiting, sources)

    # ------------------------------------------------------------------ restoring

    async def _restore_all(self, heads: tuple[int, ...]) -> None:
        try:
            for h in heads:
                if h in self.groups:
                    await self._restore(self.groups[h])
        finally:
            self.busy = False

    async def _restore(self, g: GroupPlan) -> None:
        """Layers and KV come back as the policy's `restore_prefetch` and `restore_from` say
        (sim_restore.py); then the group dissolves."""
        await restore(self, g, _ask)

    def host_link(self) -> NetworkLink:
        """A member's host <-> device link: where its dropped layers come back from after a
        fault (sim_faults.py) or under `restore_from host` (sim_restore.py)."""
        return NetworkLink(name="host copy", latency_s=0.0, bytes_per_s=self.host_bytes_per_s)

    def bubble_ratio(self) -> float:
        busy = sum(n.totals.busy_s for n in self.networks())
        stage = sum(n.totals.stage_s for n in self.networks())
        return 1.0 - busy / stage if stage else 0.0

    def pipeline_report(self) -> dict:
        """Where the bubble is: over the steps with a microbatch per stage (what formation
        balances), the share of grouped steps with fewer, and the Eq. 1-3 model's error on
        the microbatches the groups ran (lookahead only) beside the token-count model's."""
        nets = self.networks()
        steps = sum(n.totals.steps for n in nets)
        busy, stage = sum(n.full.busy_s for n in nets), sum(n.full.stage_s for n in nets)
        errs = [e for n in nets for e in n.errors]
        tok = [e for n in nets for e in n.token_errors]
        paper = [e for n in nets for e in n.paper_errors]
        return {"grouped_steps": steps,
                "short_step_share": 1 - sum(n.full.steps for n in nets) / steps if steps else None,
                "bubble_ratio_full_steps": 1 - busy / stage if stage else None,
                "cost_model_error_in_run": sum(errs) / len(errs) if errs else None,
                "token_model_error_in_run": sum(tok) / len(tok) if tok else None,
                "paper_eq1_error_in_run": sum(paper) / len(paper) if paper else None,
                "microbatches_predicted": len(errs),
                "chain_bound_steps": sum(n.chain_steps for n in nets),
                "chain_extra_s": sum(n.chain_extra_s for n in nets),
                "plans_refused": self.monitor.refused if self.monitor else None,
                "head_of_line_plans": self.monitor.head_only_plans if self.monitor else None}

    def report(self, t0: float) -> dict:
        """The bench JSON's `cluster` block: counters, bubble ratio, the Eq. 1-3 fit's error, and
        per-instance KV usage over time (each monitor round; at most 600 points)."""
        c = self.counters
        step = max(1, len(c.timeline) // 600)
        fits = [f for n in self.networks() for f in n.fits]
        return {
            **c.block(t0), "bubble_ratio": self.bubble_ratio(), **self.pipeline_report(),
            "swept": [{**x, "t": x["t"] - t0} for x in self.swept],
            "activation_stall_s": sum(x.stalled_s for n in self.networks() for x in n.exchanges),
            "restore_stall_s": sum(s for n in self.networks() for s in n.restore_stalls),
            "cost_model_error": (sum(f.mean_error for f in fits) / len(fits)) if fits else None,
            "token_model_error": (sum(f.tokens_model_error for f in fits) / len(fits))
            if fits else None,
            "kv_usage": [{"t": s["t"] - t0, "used": s["used"], "pool": s["pool"],
                          "group": s["group"], "dropped_layers": s["dropped_layers"],
                          "queued_tokens": s["queued_tokens"], "demand": s["demand"]}
                         for s in c.timeline[::step]],
        }


async def _ask(send, make):
    reply = Reply()
    await send.send(make(reply))
    return await reply.wait()


def policy_triggers(policy) -> TriggerFactory | None:
    """Compiles fresh copies of `policy`'s `overload` triggers, one per serving unit (the
    coordinator's own: triggers keep state); None when the policy has none."""
    from policy_lang.api import compile_policy  # the front door compiles; no import at start

    if not getattr(policy, "filename", None):
        return None

    def make() -> Trigger:
        own = compile_policy(policy.source, filename=policy.filename, base_dir=policy.base_dir)
        triggers = own.parts["overload"]
        return Trigger(signal=own.overload_signal,
                       rearm=lambda: setattr(triggers, "dropped", True))

    probe = compile_policy(policy.source, filename=policy.filename, base_dir=policy.base_dir)
    return make if probe.parts.get("overload") is not None else None


def overload_monitor(policy, config, engines: list) -> OverloadMonitor | None:
    """KunServe's global monitor for a cluster of in-process engines whose runners can head
    groups, when the policy has `overload` triggers; else None."""
    if not engines:
        return None
    runner = engines[0].backend.runner
    model = getattr(runner, "_model", None)
    if not hasattr(runner, "network") or model is None:
        return None
    triggers = policy_triggers(policy)
    if triggers is None:
        return None
    return OverloadMonitor(
        base_pools=[e.backend.runner.num_blocks for e in engines], block_size=config.block_size,
        num_layers=model.num_layers, weight_blocks=freed_blocks(model, config.block_size),
        triggers=triggers, pool=planned_pool(model, config.block_size))
