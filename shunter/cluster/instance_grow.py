"""`GrowGroup` in the instance process that leads a running pipeline group (KunServe §4.1: the
drop plan merged the group with an instance serving alone; the front door's side:
shunter/cluster/remote_grow.py). The new members handed their requests over first
(`ExportGroup`, as when a group forms) and wait for the head's `GroupStart`.

The head takes the requests over (their client streams made again here), then re-splits the
group on its device thread (`KunServeTorchRunner.grow`, gpu/group_grow.py) once the group's last
KV exchange has settled (retried every few milliseconds meanwhile: the steps that set up the
requests adopted last time keep running), then its scheduler adopts the new requests, grows the
pool and marks every request whose KV moves as waiting for it (`Regroup`); the arrivals task
(shared with the group's forming) turns their arrivals into `SwapDone`. A growth that cannot
start (the plan refused, the exchange not settled in time) lets the new members go with nothing
dropped and recomputes the requests they handed over here; the group goes on as it was.
"""

from __future__ import annotations

import anyio
import attrs
import structlog

from engine.cluster.drop_plan import GroupPlan
from engine.messages import Regroup
from shunter.cluster.group_wire import ExportGroup, GrowGroup

log = structlog.get_logger(actor="instance-groups")

SETTLE_S = 10.0
"""How long the head waits for its group's last exchange to settle before it gives up on a
growth (the requests adopted then must have run a step here; on these CPU tests a step takes
milliseconds)."""
SETTLE_POLL_S = 0.01


@attrs.frozen(kw_only=True)
class MergeGroup(GrowGroup):
    """A `GrowGroup` whose new members are a running group merging in (gpu/group_merge.py):
    `adopted` came from its head, and their KV lies on its members: `parts` (member index in
    `plan`, the layers it holds)."""

    parts: tuple[tuple[int, range], ...] = ()


@attrs.frozen(kw_only=True)
class HandOverGroup(ExportGroup):
    """The group this instance leads merges into the one instance `head` leads: once its last
    exchange settled, every live request is handed over (the answer: a tuple of `Moved`), the
    pool goes back to its own, and the runner serves the merged group as a member. (An
    `ExportGroup`, so the instance's link takes it as a group command.)"""


async def grow_here(ig, msg, tg) -> dict:
    """`ig`: the instance's `InstanceGroups`; `msg`: a `GrowGroup`."""
    from gpu.data_plane import GroupMemberLost
    from gpu.group_grow import NotSettled, check_grow
    from gpu.group_runner import abandon_members
    from shunter.cluster.instance_groups import GroupNotFormed, _ask

    eng, runner, plan = ig.engine, ig.runner, msg.plan
    group = getattr(runner, "group", None)
    if group is None:
        raise RuntimeError("this instance leads no group")
    if msg.check:  # refused without a traceback: the monitor may plan it again
        try:
            pool = await runner._thread.run(check_grow, group, plan)
        except ValueError as exc:
            raise GroupNotFormed(f"group {group.ranks} cannot grow to {plan.members}: "
                                 f"{exc}") from exc
        return {"pool_blocks": len(pool)}
    adopted, reqs = await ig._adopt(msg.adopted)
    if parts := getattr(msg, "parts", ()):  # a merge: their KV lies on the joining members
        adopted = [attrs.evolve(a, parts=parts) if a.owner == parts[0][0] else a
                   for a in adopted]
    new_members = tuple(plan.members[len(group.ranks):])
    deadline = anyio.current_time() + SETTLE_S
    tries = 0
    while True:
        live = (await eng.inspect()).scheduler.live_requests
        try:
            pool, own = await runner._thread.run(runner.grow, plan, tuple(adopted), live)
            break
        except NotSettled as exc:
            tries += 1
            if anyio.current_time() < deadline:
                await anyio.sleep(SETTLE_POLL_S)
                continue
            why = str(exc)
        except GroupMemberLost as exc:  # the group broke while it grew: recomputed, alone
            await _broken(ig, runner, msg, reqs)
            raise GroupNotFormed(f"group {plan.members} lost a member while it grew ({exc}); "
                                 f"every request is recomputed at instance "
                                 f"{plan.members[0]}") from exc
        except Exception as exc:  # noqa: BLE001 (refused before anything was sent: goes on)
            why = f"{type(exc).__name__}: {exc}"
        await runner._thread.run(lambda w=why: abandon_members(new_members, lost=-1, why=w))
        n = await ig._recompute_here(msg.adopted, reqs)
        raise GroupNotFormed(f"group {group.ranks} did not grow to {plan.members} ({why}); the "
                             f"{n} requests handed over are recomputed at instance "
                             f"{plan.members[0]}")
    waiting = await _ask(eng._scheduler_send, lambda r: Regroup(
        adopt=tuple(reqs), exchange=tuple(own), pool_blocks=len(pool), group=plan, reply=r))
    for (_, mv), q in zip(msg.adopted, reqs, strict=True):
        await ig.server.cancel_if_asked(mv.cluster_key, q.id)
    await ig.watch_arrivals({q.id for q in waiting}, tg)
    grown = (runner.group or runner.last_group).grow_stats  # (a step may have found it broken)
    log.info("group grew", members=plan.members, pool_blocks=len(pool), settle_tries=tries)
    return {"pool_blocks": len(pool), "adopted": len(reqs), "adopted_with_kv": len(adopted),
            "exchanging": len(waiting), "settle_tries": tries,
            "weights_copied_bytes": grown.weights_restored + grown.weights_saved,
            "kv_local_bytes": grown.kv_local, "kv_local_copied_bytes": grown.kv_local_copied,
            "kv_sent_bytes": grown.kv_sent,
            "kv_adopted_bytes": grown.kv_adopted, "kv_adopted_held_bytes": grown.kv_adopted_held}


async def hand_over_here(ig, msg: HandOverGroup, tg) -> tuple:
    """The joining group's head: waits until its group's last exchange settled (else refuses,
    nothing moved), hands every request over with the pool back to its own and a plan of one
    (its runner does not restore at that step: `handing_over`), then serves the merged group
    on its device thread (`KunServeTorchRunner.hand_over`)."""
    from gpu.group_grow import unsettled
    from shunter.cluster.instance_groups import GroupNotFormed, _ask

    eng, runner = ig.engine, ig.runner
    group = getattr(runner, "group", None)
    if group is None:
        raise RuntimeError("this instance leads no group")
    deadline = anyio.current_time() + SETTLE_S
    while waiting := await runner._thread.run(
            unsettled, group, (await eng.inspect()).scheduler.live_requests):
        if anyio.current_time() >= deadline:
            raise GroupNotFormed(f"group {group.ranks} cannot merge into instance {msg.head}'s "
                                 f"yet: requests {sorted(waiting)} still wait for its last KV "
                                 f"exchange")
        await anyio.sleep(SETTLE_POLL_S)
    me = group.ranks[0]
    solo = GroupPlan(group_id=-1, members=(me,), layers=(range(runner._model_config.num_layers),))
    runner.holding = runner.handing_over = True
    reqs = await _ask(eng._scheduler_send, lambda r: Regroup(
        export=True, pool_blocks=runner.num_blocks, group=solo, reply=r))
    out = await ig._hand_over(reqs)
    ig.serve_member(tg, runner.hand_over, msg.head, "merged group")
    return out


async def _broken(ig, runner, msg, reqs) -> None:
    """A member lost while the group grew: the runner serves alone from its host copy and let
    every member go (`KunServeTorchRunner.grow`); here the engine recomputes every request with
    its own pool, the ones the new members handed over included."""
    from shunter.cluster.instance_groups import _ask

    me = msg.plan.members[0]
    solo = GroupPlan(group_id=-1, members=(me,), layers=(
        range(runner._model_config.num_layers),))
    await _ask(ig.engine._scheduler_send, lambda r: Regroup(
        recompute=True, pool_blocks=runner.num_blocks, group=solo, reply=r))
    await ig._recompute_here(msg.adopted, reqs)
