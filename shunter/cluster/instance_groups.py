"""KunServe's group commands carried out in a torch instance process (the commands:
shunter/cluster/group_wire.py; the front door's side: shunter/cluster/remote_groups.py).

- `JoinDataPlane`: the process joins the cluster's torch.distributed world (rank = instance
  index); once per process.
- `ExportGroup` (a member): the scheduler hands every live request over (`Regroup(export)`);
  their client streams leave the frontend, each request's relay to the front door drains what
  was already produced and ends without a last chunk (the head goes on with it); then the
  runner serves the head's group on its device thread (`gpu.group_member.serve_member`) until
  the head restores. The runner still holds the exported requests' sequences then (their
  release goes with the engine's next step, which queues behind the group on the device
  thread): their KV is what the group reserves and exchanges, kept in place.
- `HeadGroup` (the head): the client streams are made again here and relayed under the
  cluster's keys; the runner opens the group now (`KunServeTorchRunner.form`, which starts the
  KV exchange; it cannot wait for a step: every request may be waiting for its KV) with each
  adopted request's owner and old id; then the scheduler adopts them, grows the pool to the
  group's and marks its own requests as waiting for their KV. A task turns the runner's
  per-request arrivals into the scheduler's `SwapDone` (an empty pipelined step asks the
  members when no step runs; a member found lost there: the head recovers as after a failed
  step and its scheduler recomputes every request). A group that cannot be opened (a plan the
  runner refuses, a member lost before the group started) leaves the head serving alone as it
  was, the members told to serve alone (gpu/group_member.py), and the requests handed over
  adopted here to be recomputed (their KV stays on, or died with, their member): the answer
  is the error, and no request waits for a group that never came.
- `LeaveGroup` (the head): the pool shrinks back (`PoolTooSmall` when the requests do not fit
  yet: the front door retries), the dropped layers come back while the group serves, and the
  next step restores the rest (shunter/cluster/instance_restore.py); with no live request, the
  runner restores at once.
"""

from __future__ import annotations

import math

import anyio
import structlog

from actors.frontend import ClientStream
from engine.cluster.adoption import PoolTooSmall
from engine.cluster.drop_plan import GroupPlan
from engine.messages import HandOverStreams, Regroup, SwapDone, TakeOverStreams
from engine.reply import Reply
from gpu.group_messages import Adopted
from shunter.cluster.instance_grow import HandOverGroup, hand_over_here
from shunter.cluster.instance_restore import RestoreLost, leave_here
from shunter.cluster.group_wire import (
    AdoptQueued,
    AskGroupStats,
    ExportGroup,
    ExportQueued,
    FreePort,
    GroupAnswer,
    GrowGroup,
    HeadGroup,
    JoinDataPlane,
    LeaveGroup,
    Moved,
)

log = structlog.get_logger(actor="instance-groups")

POLL_S = 0.005
"""How often the head looks for requests whose KV has arrived while an exchange runs."""


class InstanceGroups:
    def __init__(self, engine, server) -> None:
        """`server`: the instance's link server (shunter/cluster/instance.py): `send(msg)` to
        the front door, `keys_of(ids)` (this engine's request ids -> the cluster's keys),
        `mark_moved(keys)` and `await drained(keys)` (those keys' relays end without a last
        chunk once they relayed what their requests produced here), `relay(key, request_id,
        recv)` (relay a stream of outputs under a key)."""
        self.engine = engine
        self.server = server
        self.member_stats: dict | None = None
        self.member_task: anyio.Event | None = None
        self.arrivals: tuple[object, set[int]] | None = None
        """The group the running arrivals task serves and the requests it waits for (a group
        that grows adds its own)."""
        self.unclaimed: set[int] = set()
        """Arrivals the task took before their requests were watched (a growth's, between the
        runner's re-split and the scheduler's `Regroup`): sent when they are."""

    @property
    def runner(self):
        return self.engine.backend.runner

    async def handle(self, msg, task_group) -> None:
        try:
            match msg:
                case JoinDataPlane():
                    value = await anyio.to_thread.run_sync(_join, msg)
                case HandOverGroup():  # (an ExportGroup: first)
                    value = await hand_over_here(self, msg, task_group)
                case ExportGroup():
                    value = await self._export(msg, task_group)
                case HeadGroup():
                    value = await self._head(msg, task_group)
                case GrowGroup():
                    from shunter.cluster.instance_grow import grow_here

                    value = await grow_here(self, msg, task_group)
                case LeaveGroup():
                    value = await self._leave()
                case AskGroupStats():
                    value = self._stats()
                case FreePort():
                    from gpu.data_plane import free_port

                    value = free_port("")
                case ExportQueued():
                    value = await self._hand_over(await _ask(
                        self.engine._scheduler_send,
                        lambda r: Regroup(export_queued=True, reply=r)))
                case AdoptQueued():
                    value = await self._adopt_queued(msg)
            answer = GroupAnswer(key=msg.key, value=value)
        except PoolTooSmall as exc:
            answer = GroupAnswer(key=msg.key, error=str(exc), too_small=True)
        except (GroupNotFormed, RestoreLost) as exc:  # handled here already: no traceback
            log.error("group not formed" if isinstance(exc, GroupNotFormed)  # (it is slow)
                      else "group lost while restoring", error=str(exc))
            answer = GroupAnswer(key=msg.key, error=str(exc))
        except Exception as exc:  # reported to the front door, which names the instance
            log.exception("group command failed", command=type(msg).__name__)
            answer = GroupAnswer(key=msg.key, error=f"{type(exc).__name__}: {exc}")
        await self.server.send(answer)

    # ------------------------------------------------------------------ member

    async def _export(self, msg: ExportGroup, tg) -> tuple[Moved, ...]:
        if not hasattr(self.runner, "form"):
            raise RuntimeError("this instance's runner cannot serve KunServe pipeline groups "
                               "(the torch backend's KunServeTorchRunner can)")
        eng = self.engine
        self.runner.holding = True  # the exported requests' sequences stay for the group
        reqs = await _ask(eng._scheduler_send, lambda r: Regroup(export=True, reply=r))
        out = await self._hand_over(reqs)
        self.serve_member(tg, self.runner.serve_group, msg.head, "group")
        return out

    def serve_member(self, tg, serve, head: int, what: str) -> None:
        """Serve instance `head`'s group as a member (`serve(head)`, the runner's loop, on its
        device thread) until it returns this member's counters (`member_stats`: None until
        then). `what`: the group, in the log."""
        self.member_stats = None
        done = self.member_task = anyio.Event()

        async def run() -> None:
            try:
                stats = await self.runner._thread.run(serve, head)
                log.info(f"{what} left", stats=stats)
                if self.member_task is done:  # (not once it serves another group)
                    self.member_stats = stats
            except Exception:  # its layers are gone: the instance ends (the head sees it lost)
                log.exception(f"serving the {what} failed", head=head)
                raise
            finally:
                done.set()

        tg.start_soon(run)

    async def _hand_over(self, reqs) -> tuple[Moved, ...]:
        """The client streams of `reqs` (exported by the scheduler) leave the frontend; each
        relay drains what its request produced here and ends quietly; then their `Moved`."""
        eng = self.engine
        streams = await _ask(eng._frontend_send, lambda r: HandOverStreams(
            request_ids=tuple(q.id for q in reqs), reply=r)) if reqs else {}
        keys = self.server.keys_of(tuple(q.id for q in reqs))
        self.server.mark_moved(list(keys.values()))
        out = []
        for q in reqs:
            cs = streams.get(q.id)
            state = {} if cs is None else {
                "stop": cs.stop, "text": cs.text, "emitted": cs.emitted, "stopping": cs.stopping,
                "gone": cs.gone, "stream": cs.stream, "held_ids": list(cs.held_ids),
                "held_text": list(cs.held_text)}
            if cs is not None:
                cs.send.close()  # its relay drains what was produced, then ends quietly
            out.append(Moved(cluster_key=keys[q.id], request=q, stream=state))
        await self.server.drained(list(keys.values()))
        return tuple(out)

    # ------------------------------------------------------------------ head

    async def _head(self, msg: HeadGroup, tg) -> dict:
        eng, runner, plan = self.engine, self.runner, msg.plan
        adopted, reqs = await self._adopt(msg.adopted)
        cannot = None if hasattr(runner, "form") else (
            f"instance {plan.members[0]}'s runner cannot lead KunServe pipeline groups")
        if msg.not_formed is not None or cannot:  # another member could not join, or this
            from gpu.group_runner import abandon_members  # (the front door checks at start)

            # only the members that exported wait for this group's start
            given_up = msg.not_formed is not None
            members = msg.exported if given_up else plan.members[1:]
            why = msg.not_formed if given_up else cannot
            await runner._thread.run(lambda: abandon_members(members, lost=-1, why=why))
            n = await self._recompute_here(msg.adopted, reqs)
            if given_up:
                return {"adopted": n, "formed": False}
            raise GroupNotFormed(f"group {plan.members} not formed ({cannot}); the {n} "
                                 f"requests handed over are recomputed at instance "
                                 f"{plan.members[0]}")
        runner.microbatch, runner.kv_exchange = msg.microbatch, msg.kv_exchange
        # own: exactly the requests whose KV the runner exchanges (a request that ran its
        # first step after the group opened has all of its KV in the group already)
        try:
            pool, own = await runner._thread.run(runner.form, plan, tuple(adopted))
        except Exception as exc:  # re-raised: nothing waits for this group
            n = await self._recompute_here(msg.adopted, reqs)
            raise GroupNotFormed(f"group {plan.members} not formed ({type(exc).__name__}: "
                                 f"{exc}); the {n} requests handed over are recomputed at "
                                 f"instance {plan.members[0]}") from exc
        waiting = await _ask(eng._scheduler_send, lambda r: Regroup(
            adopt=tuple(reqs), exchange=tuple(own), pool_blocks=len(pool), group=plan, reply=r))
        for (_, mv), q in zip(msg.adopted, reqs, strict=True):
            await self.server.cancel_if_asked(mv.cluster_key, q.id)
        await self.watch_arrivals({q.id for q in waiting}, tg)
        from shunter.cluster.group_keepalive import keepalive

        tg.start_soon(keepalive, self, runner.group)
        return {"pool_blocks": len(pool), "adopted": len(reqs), "adopted_with_kv": len(adopted),
                "exchanging": len(waiting)}

    async def _recompute_here(self, adopted, reqs) -> int:
        """Requests handed over for a group that was not formed: adopted by this instance's
        scheduler to be prefilled again (`Regroup.adopt_recompute`) from their whole context."""
        if reqs:
            await _ask(self.engine._scheduler_send, lambda r: Regroup(
                adopt=tuple(reqs), adopt_recompute=True, reply=r))
        for (_, mv), q in zip(adopted, reqs, strict=True):
            await self.server.cancel_if_asked(mv.cluster_key, q.id)
        return len(reqs)

    async def _adopt_queued(self, msg: AdoptQueued) -> int:
        """Requests with no KV from an instance serving alone: set up here like new ones."""
        if self.runner.group is None:
            raise RuntimeError("this instance leads no group")
        reqs = [q for _, q in await self._take_over(msg.moved)]
        if reqs:
            await _ask(self.engine._scheduler_send, lambda r: Regroup(adopt=tuple(reqs), reply=r))
        for mv, q in zip(msg.moved, reqs, strict=True):
            await self.server.cancel_if_asked(mv.cluster_key, q.id)
        return len(reqs)

    async def _adopt(self, handed) -> tuple[list[Adopted], list]:
        """The requests members hand over ((owner, move) pairs) taken over here: the ones whose
        KV comes from their owner (`Adopted`), and every request."""
        adopted, reqs = [], []
        for (owner, mv), (old, q) in zip(handed, await self._take_over(
                [mv for _, mv in handed]), strict=True):
            if q.computed_tokens and q.state != "swapped":
                adopted.append(Adopted(request_id=q.id, owner=owner, old_request_id=old,
                                       kv_tokens=q.computed_tokens))
            reqs.append(q)
        return adopted, reqs

    async def _take_over(self, moved) -> list[tuple[int, object]]:
        """The moved requests' client streams made again here and relayed under their cluster
        keys; each request gets its id here (returned with its old one); its setup here will
        carry its whole context (engine/step_plan.py). Requests of different instances may
        share an old id: taken over in runs whose old ids differ."""
        out, run = [], []
        for mv in moved:
            if any(m.request.id == mv.request.id for m in run):
                out += await self._take_over_run(run)
                run = []
            run.append(mv)
        return out + (await self._take_over_run(run) if run else [])

    async def _take_over_run(self, moved) -> list[tuple[int, object]]:
        eng = self.engine
        streams, recvs = {}, {}
        for mv in moved:
            q = mv.request
            send, recv = anyio.create_memory_object_stream(math.inf)
            codec = eng.backend.codec
            detok = codec.detokenizer() if codec is not None and mv.stream else None
            if detok is not None and q.output_ids:
                detok.add(list(q.output_ids))  # where the member's detokenizer was
            streams[q.id] = ClientStream(send=send, detok=detok, **(mv.stream or {"stop": ()}))
            recvs[q.id] = recv
        new_ids = await _ask(eng._frontend_send, lambda r: TakeOverStreams(
            streams=streams, reply=r)) if streams else {}
        out = []
        for mv in moved:
            q = mv.request
            old, q.id = q.id, new_ids[q.id]
            self.server.relay(mv.cluster_key, q.id, recvs[old])
            out.append((old, q))
        return out

    async def watch_arrivals(self, ids: set[int], tg) -> None:
        """Turn these requests' arrivals into `SwapDone`s (call once the scheduler marked them
        waiting): added to the running task's set (one task takes the group's arrivals: two
        would each drop the other's), else a new task."""
        group = self.runner.group
        if self.arrivals is not None and self.arrivals[0] is group:
            early = set(ids) & self.unclaimed
            self.unclaimed -= early
            self.arrivals[1].update(set(ids) - early)
            if early:
                await self.engine._scheduler_send.send(SwapDone(request_ids=tuple(sorted(early))))
        else:  # (a task of a group that ended leaves by itself)
            self.arrivals, self.unclaimed = (group, set(ids)), set()
            tg.start_soon(self._arrivals, self.arrivals[1])

    async def _arrivals(self, waiting: set[int]) -> None:
        """Each request's KV arrival on every member becomes a `SwapDone` for the scheduler."""
        try:
            await self._arrivals_loop(waiting)
        finally:
            if self.arrivals is not None and self.arrivals[1] is waiting:
                self.arrivals = None

    async def _arrivals_loop(self, waiting: set[int]) -> None:
        runner, idle = self.runner, 0
        group = runner.group
        while waiting and runner.group is group and group is not None:
            got = await runner._thread.run(_arrived, runner, group, idle >= 3)
            if got is None:  # a member was lost: every request is recomputed, solo again
                me = group.ranks[0]
                solo = GroupPlan(group_id=-1, members=(me,), layers=(
                    range(runner._model_config.num_layers),))
                await _ask(self.engine._scheduler_send, lambda r, solo=solo: Regroup(
                    recompute=True, pool_blocks=runner.num_blocks, group=solo, reply=r))
                return
            self.unclaimed.update(r for r in got if r not in waiting)
            got = [r for r in got if r in waiting]
            idle = 0 if got else idle + 1
            if got:
                waiting.difference_update(got)
                await self.engine._scheduler_send.send(SwapDone(request_ids=tuple(got)))
            await anyio.sleep(POLL_S)

    async def _leave(self) -> dict:
        return await leave_here(self)

    def _stats(self) -> dict:
        runner = self.runner
        g = getattr(runner, "group", None) or getattr(runner, "last_group", None)
        head = None
        if g is not None:
            ex = g.exchange
            head = {"sent_bytes": ex.sent_bytes, "received_bytes": ex.received_bytes,
                    "chunks_received": ex.chunks_received, "restore": dict(g.restore_stats),
                    "leading": runner.group is not None, "pipeline": g.pipeline_report(),
                    "kv_exchange": g.kv_exchange}
        return {"head": head, "member": self.member_stats, "lost": getattr(runner, "lost", None),
                "can_lead": hasattr(runner, "form"),
                "kv_moved_bytes": getattr(runner, "kv_moved_bytes", None)}


class GroupNotFormed(RuntimeError):
    """The head could not open the group; the requests handed over are recomputed here."""


def _arrived(runner, group, poll: bool) -> list[int] | None:
    """On the device thread: the requests whose KV is complete on every member; with `poll`,
    an empty pipelined step first asks the members (no step has run for a while). None: that
    step found a member lost (the runner serves alone again, every request's KV gone)."""
    from gpu.data_plane import GroupMemberLost

    if runner.group is not group:
        return []
    if not poll:
        return group.arrived()
    try:
        return group.poll(0)
    except GroupMemberLost as exc:
        runner.lose_group(exc)
        return None


def _join(msg: JoinDataPlane) -> int:
    from gpu.data_plane import data_plane, join_data_plane

    try:
        plane = data_plane()
    except RuntimeError:
        plane = join_data_plane(msg.init, msg.rank, msg.world, timeout_s=msg.timeout_s)
    if (plane.rank, plane.world_size) != (msg.rank, msg.world):
        raise RuntimeError(f"this process joined the data plane as rank {plane.rank} of "
                           f"{plane.world_size}, not {msg.rank} of {msg.world}")
    return plane.rank


async def _ask(send, make):
    reply = Reply()
    await send.send(make(reply))
    return await reply.wait()
