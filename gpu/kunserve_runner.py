"""The torch step runner that follows the engine's KunServe fields on `ExecuteStep` (the
engine side: engine/cluster/adoption.py): `group` (a `GroupPlan`: from this step run
as a pipeline over its members; a plan of one member: alone again), `pool_blocks` (the pool's
new size) and `moves` (blocks a shrinking pool relocated). The executor keeps calling one
runner; this one delegates to a `GroupRunner` (gpu/group_runner.py) while its instance heads a
group. Member instances do not step while grouped: they serve the head (`serve_member`).

What the step fields cannot carry is handed over before the step that forms the group:
`expect_adopted(...)`, the requests that moved here from other members, with the owner's ids.
An instance process (shunter/cluster/instance_groups.py) instead opens the group itself with
`form(plan, adopted)` before its scheduler learns of it (the exchange must start even when
every request waits for its KV and no step comes); the step that carries the plan then finds
it open. A request that moved here, or is recomputed after its group lost a member, is set
up again with its whole context (engine/step_plan.py): this runner keeps nothing for it between
its release and its setup (so nothing is left when it ends before it).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import structlog

from engine.cluster.stage_fits import StageFits
from engine.cost_model import BatchShape
from engine.messages import ExecuteStep, StepFinished
from gpu.data_plane import GroupMemberLost
from gpu.group_runner import GroupRunner
from gpu.group_messages import Adopted
from gpu.restore_group import RestoreNotStarted
from gpu.runner import TorchRunner

log = structlog.get_logger(actor="kunserve-runner")

RESTORE_TRIES = 3
"""How many times a restore that fails before changing anything is tried (at consecutive
steps) before the group is given up (`_restore_at`)."""


class KunServeTorchRunner(TorchRunner):
    GROUP_MODES = ("fifo", "coordinated", "tokens", "lookahead", "restore_prefetch on",
                   "restore_prefetch off", "restore_from peer", "restore_from host")
    """KunServe group settings it honours: the exchanged KV goes in chunks behind activations
    (gpu/transfer.py's two lanes: `kv_exchange coordinated`) or in one queue with them, in
    order (`fifo`, the ablation without coordination); microbatches are cut by tokens or by
    lookahead (the head cuts each step with Eq. 1-3 fitted per stage on the microbatches the
    group ran: engine/cluster/stage_fits.py); a restore is prefetched while the group serves
    or done at one step, its weights from peers or each member's host copy (the policy's
    `restore_prefetch`, `restore_from`: shunter/cluster/instance_restore.py). Groups form on
    clusters of instance processes (shunter/cluster/remote_groups.py)."""

    def __init__(self, *args, chunk_blocks: int = 4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chunk_blocks = chunk_blocks
        self.group: GroupRunner | None = None
        self._adopted: tuple[Adopted, ...] = ()
        self.kv_moved_bytes = 0
        """KV bytes moved between the members of the groups this instance led, every member's
        (gpu/kv_moved.py); never reset."""
        self.last_group: GroupRunner | None = None
        """The group runner of the last group led (its counters outlive it)."""
        self.last_ended: str | None = None
        """How it ended: "restored", "lost" (a member gone, or its restore given up), or
        "merged" (handed over to another head, gpu/group_merge.py)."""
        self.lost: str | None = None
        """Why the group this instance led broke (a member went away), once it did."""
        self._kv_lost: set[int] = set()
        self.microbatch = "tokens"
        """How a group this instance leads cuts its steps (the policy's `microbatch`)."""
        self.kv_exchange = "coordinated"
        """How a group this instance leads sends its KV (the policy's `kv_exchange`)."""
        self._lost_ranks: tuple[int, ...] = ()
        """The members of the last group lost: a step still carrying its plan (scheduled
        before the engine learnt of the loss) does not open it again."""
        self.stage_fits: dict[tuple, object] = {}
        """Eq. 1-3 per stage, by the group's layer split: a later group goes on from them."""
        self.cost_model = None
        """The engine's fitted profile (`EngineConfig.cost_profile`), if any: a split's fits
        start from it (offline profiling, §4.3) instead of from nothing."""
        self.holding = False
        """A member about to serve a group: steps do not release sequences (the engine
        releases the requests it exported, whose KV the group still needs) until
        `serve_group` takes them."""
        self.restore_prefetch = True
        """An instance process's restore writes the dropped layers back while the group serves
        (shunter/cluster/instance_restore.py); False: all at the restore's step. The policy's
        `restore_prefetch`, set at each restore (`LeaveGroup`)."""
        self.restore_source = "peer"
        """Where a restore of the group this instance leads takes the dropped layers from
        ('peer' or 'host': the policy's `restore_from`, set at each restore)."""
        self._prefetch_after: tuple[str, int | None] | None = None
        self.prefetch_refused: str | None = None
        """Why the last restore prefetch waiting for a shrink could not start, if it could
        not (its group restored everything at the boundary)."""
        self._engine_pool: int | None = None
        """The engine's pool size while it leads a group, as the last step that resized it
        said (None: the group's whole pool)."""
        self.handing_over = False
        """Its group merges into another (`hand_over`): the step carrying the engine's plan of
        one does not restore it (its KV goes to the merged group's members instead)."""
        self.restore_failures: list[str] = []
        """Why each try of the pending restore failed (`_restore_at`); [] when none is due."""

    def hand_over(self, head: int) -> dict:
        """The group this instance leads merges into the one instance `head` leads, its
        scheduler having handed every request over (gpu/group_merge.py `hand_over_group`): it
        serves that group as a member, on the device thread, until it restores."""
        from gpu.group_merge import hand_over_group

        self._restoring("merge into another")
        self.holding = False
        return hand_over_group(self, head)

    def serve_group(self, head: int) -> dict:
        """A member's part in the group led by instance `head`, on the device thread, until the
        head restores (gpu/group_member.py `serve_member`); its sequences go to the group."""
        from gpu.group_member import serve_member

        self.holding = False
        return serve_member(self, head)

    def prefetch_restore(self, source: str = "peer", after_shrink_to: int | None = None
                         ) -> bool:
        """Start restoring the group this instance leads while it keeps serving: every
        member's dropped layers are written back in place (gpu/restore_prefetch.py) and the
        step whose plan is of one later moves only the rest. The engine's pool must have shrunk
        back first (a step carrying that `pool_blocks` ran, its moves applied: its ids are what
        stays); `after_shrink_to`: until a step carried a pool of at most that many blocks,
        the prefetch waits (it starts before the next step after it). Returns whether it
        started; one that cannot start says why in `prefetch_refused` (the restore then moves
        everything at its boundary). On the device thread."""
        if self.group is None:
            raise RuntimeError("this instance leads no group")
        self._prefetch_after, self.prefetch_refused = (source, after_shrink_to), None
        return self.start_pending_prefetch()

    @property
    def prefetch_pending(self) -> bool:
        """A prefetch waits for the step that carries the pool's shrink."""
        return self._prefetch_after is not None

    def start_pending_prefetch(self) -> bool:
        """A prefetch waiting for the pool's shrink starts once a step carried it."""
        pending, group = self._prefetch_after, self.group
        if pending is None or group is None:
            return False
        source, after = pending
        n = self._engine_pool if self._engine_pool is not None else len(group.pool)
        if after is not None and n > after:
            return False
        self._prefetch_after = None
        try:
            group.prefetch_restore(source, range(group.pool.start, group.pool.start + n))
        except GroupMemberLost:
            raise
        except (ValueError, RuntimeError) as exc:
            self.prefetch_refused = str(exc)
            return False
        return True

    def _restoring(self, what: str) -> None:
        if self.group is not None and self.group.stage.prefetch is not None:
            raise RuntimeError(f"the group this instance leads is restoring (its dropped layers "
                               f"are being prefetched): it cannot {what}")

    def _group(self, plan, adopted: Sequence[Adopted]) -> GroupRunner:
        self._engine_pool = self._prefetch_after = None
        return GroupRunner(self, plan.members, plan.layers, adopted,
                           chunk_blocks=self.chunk_blocks, microbatch=self.microbatch,
                           fits=self._fits(plan), kv_exchange=self.kv_exchange)

    def _fits(self, plan) -> StageFits:
        split = tuple((r.start, r.stop) for r in plan.layers)
        fits = self.stage_fits.get(split)
        if fits is None:
            fits = self.stage_fits[split] = StageFits(len(plan.members))
            cost = self.cost_model
            if cost is not None:
                layers = self._model_config.num_layers
                fits.seed(lambda chunks: cost.predict_ms(BatchShape.of(chunks)),
                          [len(r) / layers for r in plan.layers],
                          max_context=self._model_config.max_position_embeddings)
        return fits

    def form(self, plan, adopted: Sequence[Adopted]) -> tuple[range, tuple[int, ...]]:
        """Open the group `plan` (members in pipeline order, this instance first) now, with the
        requests `adopted` from members; returns the group's block ids and this instance's
        own requests whose KV is exchanged (exactly those: each gets its arrival). Runs on the
        device thread (`_thread.run`). When the group cannot be opened (a plan it cannot run,
        a member lost before it started) this instance is left serving alone as it was, its
        own requests' KV in place, and every member is told (gpu/group_member.py)."""
        if self.group is not None:
            raise RuntimeError(f"already leading group {self.group.ranks}")
        own = tuple(rid for rid, s in self._seqs.items() if s.table)
        try:
            group = self._group(plan, adopted)
        except Exception as exc:  # re-raised: the members waiting to start are let go
            from gpu.group_runner import abandon_members

            abandon_members(plan.members[1:], lost=-1, why=f"the head refused the plan: {exc}")
            raise
        pool = group.open()
        self.group = group
        return pool, own

    def grow(self, plan, adopted: Sequence[Adopted], live=None) -> tuple[range, tuple[int, ...]]:
        """The group this instance leads grows to `plan` (its members first, then the new
        ones, which handed `adopted` over): gpu/group_grow.py. Returns the grown pool's block
        ids and the live requests whose KV moves. On the device thread; the step that carries
        the plan then finds it open. A member lost while it grows (`GroupMemberLost`,
        re-raised): this instance serves alone from its host copy and every member left, old
        or new, is told to (in the same call: no step runs on the broken group); the caller
        has the engine recompute every request."""
        from gpu.group_grow import grow_group
        from gpu.group_runner import abandon_members

        if self.group is None:
            raise RuntimeError("this instance leads no group")
        self._restoring("grow")
        try:
            return grow_group(self.group, plan, adopted, fits=self._fits(plan), live=live)
        except GroupMemberLost as exc:
            new = [r for r in plan.members if r not in self.group.ranks]
            self.lose_group(exc)  # the old members are told
            abandon_members(new, lost=exc.rank, why=f"the group lost a member while it grew: "
                                                    f"{exc}")
            raise

    def dissolve_idle(self) -> bool:
        """Restore now when no request is live on this engine (none will step to carry the
        restore): every sequence left on the group is one whose release no step carried yet.
        False when no group is open. A restore that fails before changing anything
        (`RestoreNotStarted`) is raised, the group kept, and counts as a try (`_restore_at`):
        the last one gives the group up (every member told, as after a loss)."""
        group = self.group
        if group is None:
            return False
        try:
            group.restore({}, self.restore_source, release=tuple(group.stage.seqs))
        except GroupMemberLost as exc:
            self.lose_group(exc)
            raise
        except RestoreNotStarted as exc:  # the group kept (the front door asks again), at
            self.restore_failures.append(str(exc))  # most `RESTORE_TRIES` times in all
            if len(self.restore_failures) < RESTORE_TRIES:
                raise
            why = f"the group's restore failed {RESTORE_TRIES} times (last: {exc})"
            log.error("restore given up; the group ends", error=why)
            self.lose_group(RuntimeError(why), lost=-1)  # (nothing live to recompute)
            return True
        self.group, self.last_group, self.restore_failures = None, group, []
        self.last_ended = "restored"
        return True

    def expect_adopted(self, adopted: Sequence[Adopted]) -> None:
        """The requests the next group-forming step's plan adopts (ids on this engine, owner
        member index, the owner runner's id, tokens of KV there)."""
        self._adopted = tuple(adopted)

    def execute(self, step: ExecuteStep) -> StepFinished:
        plan = step.group
        if self.holding and step.release:
            step = attrs.evolve(step, release=())
        if self.handing_over and plan is not None and len(plan.members) == 1:
            step = attrs.evolve(step, group=None, pool_blocks=None, moves=())
            plan = None
        if (plan is not None and self.group is None and self.lost is not None
                and tuple(plan.members) == self._lost_ranks):  # lost before this step came
            step = attrs.evolve(step, group=None, pool_blocks=None)
            plan = None
        if (plan is not None and len(plan.members) > 1 and self.group is not None
                and self.group.ranks == tuple(plan.members)):  # opened by form()
            if step.pool_blocks is not None and step.pool_blocks > len(self.group.pool):
                raise RuntimeError(f"the engine's group pool of {step.pool_blocks} blocks is "
                                   f"larger than the group's {len(self.group.pool)}")
        elif plan is not None and len(plan.members) > 1:
            if self.group is not None:
                raise RuntimeError(f"already leading group {self.group.ranks}; got plan "
                                   f"{plan.members}")
            self.group = self._group(plan, self._adopted)
            self._adopted = ()
            pool = self.group.open()
            if step.pool_blocks is not None and step.pool_blocks > len(pool):
                raise RuntimeError(f"the engine's group pool of {step.pool_blocks} blocks is "
                                   f"larger than the group's {len(pool)} ({pool})")
        elif (plan is not None or self.restore_failures) and self.group is not None:
            if self._restore_at(step):  # a plan of one (or a restore retried): alone again
                step = attrs.evolve(step, release=(), moves=(), group=None, pool_blocks=None)
            else:  # not restored yet: the group runs this step
                step = attrs.evolve(step, group=None)
        if self.group is not None:
            try:
                self.start_pending_prefetch()  # (before this step's own pool is noted)
                if step.pool_blocks is not None:
                    self._engine_pool = step.pool_blocks
                return self.group.execute(step)
            except GroupMemberLost as exc:
                self._group_lost(exc)
        if self.lost is not None:
            self._refuse_lost(step)
        return super().execute(step)

    def _restore_at(self, step: ExecuteStep) -> bool:
        """Restore the group this instance leads at `step`: True once it is alone again. A
        restore that failed before it changed anything (`RestoreNotStarted`: a prefetched KV
        round still due after `KV_JOIN_S`) leaves the group serving `step` (no request fails;
        the engine, alone already, sends no plan again) and is tried again at each next step,
        `RESTORE_TRIES` times in all; then it is given up, logged: the group ends as if a
        member was lost (every member writes its dropped layers from its host copy) and the
        engine recomputes every request (`GroupLost`)."""
        moved = dict(step.moves)
        tables = {rid: [moved.get(b, b) for b in s.table]
                  for rid, s in self.group.stage.seqs.items() if rid not in step.release}
        try:
            self.group.restore(tables, self.restore_source, release=step.release)
        except GroupMemberLost as exc:
            self._group_lost(exc)
        except RestoreNotStarted as exc:
            self.restore_failures.append(str(exc))
            tries = len(self.restore_failures)
            if tries < RESTORE_TRIES:
                log.error("restore failed; the group serves on and tries again at its next step",
                          step_id=step.step_id, tries=tries, error=str(exc))
                return False
            log.error("restore given up; the group ends, its requests are recomputed",
                      step_id=step.step_id, tries=tries, error=str(exc))
            why = f"the group's restore failed {tries} times (last: {exc})"
            self.lose_group(RuntimeError(why), lost=-1)
            raise GroupLost(f"{why}; this instance serves alone again from its host copy and "
                            f"recomputes its requests", self.num_blocks) from exc
        group, self.group = self.group, None
        group.restore_stats["failed_tries"] = self.restore_failures
        self.last_group, self.restore_failures, self.last_ended = group, [], "restored"
        return True

    def _group_lost(self, exc: GroupMemberLost) -> None:
        """A member went away: this instance serves alone again with its dropped layers from
        its host copy (the other survivors do the same); every request's KV is lost with the
        member's layers. Raises `GroupLost`: the engine recomputes every request (each is
        released and set up again with its whole context) and shrinks its pool to
        this runner's own; until then a step naming a request whose KV is gone fails the same
        way (`GroupLost`: recomputed, never failed)."""
        self.lose_group(exc)
        raise GroupLost(f"{exc}; this instance serves alone again from its host copy and "
                        f"recomputes its requests", self.num_blocks) from exc

    def lose_group(self, exc: Exception, lost: int | None = None) -> None:
        """`_group_lost` without raising: for a loss found outside a step (an empty step that
        asked the members for arrivals); the caller tells the engine to recompute. `lost`:
        the member gone (`exc.rank`), or -1 for none (a restore given up)."""
        group, self.group = self.group, None
        self.last_group, self.last_ended = group, "lost"
        self.lost = str(exc)
        self._lost_ranks = group.ranks
        self.restore_failures = []
        if lost is None and exc.rank >= 0:
            group.recover_from_host(exc.rank)
        else:  # (none gone: every member told why)
            group.recover_from_host(-1, why=str(exc))
        self._kv_lost = set(self._seqs)

    def _refuse_lost(self, step: ExecuteStep) -> None:
        for rid in step.release:
            self._kv_lost.discard(rid)
        for u in step.blocks:
            if u.reset:  # recomputed from its tokens: no KV is assumed
                self._kv_lost.discard(u.request_id)
        solo = self._model.arena.kv_block_ids
        for w in step.seqs:
            if w.request_id in self._kv_lost:  # scheduled before the engine learnt of it
                raise GroupLost(f"request {w.request_id} lost its KV with its pipeline group "
                                f"({self.lost}): recomputed", self.num_blocks)
        for u in step.blocks:  # scheduled on a group pool the engine learnt of after the loss
            if any(b not in solo for b in u.append):  # (a growth's `Regroup` came after it):
                raise GroupLost(f"block ids beyond this instance's own pool {solo} while its "
                                f"group's pool is let go ({self.lost}): every request is "
                                f"recomputed with its own pool", self.num_blocks)


class GroupLost(RuntimeError):
    """The step's pipeline group lost a member: the runner serves alone again and every
    request's KV is gone (the executor's `StepFailed.kv_lost`: the engine recomputes them)."""

    kv_lost = True

    def __init__(self, message: str, pool_blocks: int) -> None:
        super().__init__(message)
        self.pool_blocks = pool_blocks
