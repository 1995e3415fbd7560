"""Fit a policy's order to one iteration's budgets: device blocks, tokens and sequences.

Pure mechanism, no I/O and no policy names. Two passes, as in vLLM's scheduler:
1. running requests, most deserving first: each gets its next tokens (a decode token or the next
   prefill chunk); when blocks run short, the least deserving running request is preempted;
2. the others (waiting, swapped), in order, while they fit; with `displace` they may evict running
   requests that deserve less. Admission is strict: the first request that does not fit stops it,
   so nobody behind it jumps ahead. A swapped request is admitted with the blocks its KV needs on
   the device; with asynchronous swap-in it computes nothing this iteration (its KV is still
   arriving) and joins the running batch once the swap pool reports it.
A packed policy (BROS) names its batch, the first `Decision.batch` requests of its order: only
they get work, and the rest of the order only ranks the running requests as victims.
With `prefill separate` (vLLM V0) the passes run the other way round and exclude each other:
whole prompts first, and decodes only in an iteration that took none (`separate_phases`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from functools import cached_property

import attrs

from engine.policy import Decision, PolicySettings, RequestView, SchedulerView


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@attrs.frozen(kw_only=True)
class Budget:
    free_blocks: int
    total_blocks: int
    block_size: int
    max_num_seqs: int
    max_batched_tokens: int
    can_preempt: bool = True
    max_running: Mapping[str, int] = attrs.field(factory=dict)
    """Per-class limit on running requests."""
    async_swap_in: bool = False
    """Swapped requests admitted now are swapped in asynchronously (no work this iteration)."""
    separate_prefill: bool = False
    """`prefill separate`: whole prompts alone, else decodes (`_Planner.separate_phases`)."""
    watermark_blocks: int = 0
    """Blocks a prompt admitted by `separate_phases` must leave free."""
    short_self: bool = False
    """`short_of_block = self`: a running request that lacks a block is preempted itself instead
    of evicting running requests ranked below it (BROS §7.4.1's ablation without the cache)."""

    @classmethod
    def for_view(cls, view: SchedulerView, settings: PolicySettings, *,
                 async_swap_in: bool = False) -> Budget:
        """The budgets of the iteration `view` shows, under the running policy's limits."""
        return cls(
            free_blocks=view.free_blocks, total_blocks=view.total_blocks,
            block_size=view.block_size, max_num_seqs=view.max_num_seqs,
            max_batched_tokens=settings.token_budget or view.max_batched_tokens,
            can_preempt=settings.preempt_mode != "never",
            max_running={k.name: k.max_running for k in settings.classes
                         if k.max_running is not None},
            async_swap_in=async_swap_in, separate_prefill=settings.prefill == "separate",
            watermark_blocks=int(settings.prompt_watermark * view.total_blocks),
            short_self=settings.short_of_block == "self")


@attrs.define
class IterationPlan:
    work: dict[int, int] = attrs.field(factory=dict)
    """request id -> tokens to compute this iteration, in scheduling order."""
    views: dict[int, RequestView] = attrs.field(factory=dict)
    """request id -> the view it was given work from (what the policy is told it served)."""
    block_targets: dict[int, int] = attrs.field(factory=dict)
    """request id -> device blocks it must hold after this iteration (a count, not a growth)."""
    admitted: list[RequestView] = attrs.field(factory=list)
    """Waiting or swapped requests that join this iteration, in order."""
    swapped_in: list[RequestView] = attrs.field(factory=list)
    """Swapped requests whose KV comes back this iteration (also in `work` when synchronous)."""
    preempted: list[RequestView] = attrs.field(factory=list)
    """Running requests that lose their device blocks this iteration."""
    forced: bool = False
    """A preemption happened although the policy forbids it (everything else was stuck)."""


class _Planner:
    def __init__(self, decision: Decision, requests: Sequence[RequestView], budget: Budget) -> None:
        self.budget = budget
        self.free = budget.free_blocks
        self.tokens = budget.max_batched_tokens
        self.seq_limit = min(budget.max_num_seqs, decision.max_batch or budget.max_num_seqs)
        self.displace = decision.displace
        self._decision, self._requests = decision, requests
        # a packed batch (BROS §4.2): only its requests get work; the rest of the order ranks
        # the running requests that may be preempted for it
        self.order = decision.order if decision.batch is None else decision.order[:decision.batch]
        self.running = [r for r in self.order if r.state == "running"]
        self.plan = IterationPlan()
        self.preempted_ids: set[int] = set()
        self.blocked_without_preemption = False
        """A running request could not get its blocks and the policy forbids preemption."""

    # Built on first use: with a long queue (thousands waiting in a replayed burst) each is a
    # pass over it, and most iterations preempt no one and admit under no class limit.
    @cached_property
    def rank(self) -> dict[int, int]:
        return {r.id: i for i, r in enumerate(self._decision.order)}

    @cached_property
    def victims(self) -> deque[RequestView]:
        """The running requests, least deserving first."""
        rank = self.rank
        unranked = [r for r in self._requests if r.state == "running" and r.id not in rank]
        ranked = [r for r in self._decision.order if r.state == "running"]
        return deque(unranked + ranked[::-1])

    @cached_property
    def per_class(self) -> dict[str, int]:
        """Running requests per class, as the plan goes."""
        counts: dict[str, int] = {}
        for r in self._requests:
            if r.state == "running":
                counts[r.request_class] = counts.get(r.request_class, 0) + 1
        return counts

    def full(self) -> bool:
        return len(self.plan.work) >= self.seq_limit or self.tokens <= 0

    def need(self, r: RequestView, n: int) -> int:
        """Blocks r takes from the free count to compute n more tokens. A waiting request with
        a prefix cache hit starts after its cached blocks and pays only for those no live
        request holds (idle ones count as free until taken)."""
        bs = self.budget.block_size
        if r.cached_tokens:
            return (blocks_for(r.cached_tokens + n, bs) - r.cached_tokens // bs
                    + r.cached_idle_blocks)
        return blocks_for(r.computed_tokens + n, bs) - r.blocks

    def commit(self, r: RequestView, n: int, need: int) -> None:
        self.free -= need
        self.tokens -= n
        self.plan.work[r.id] = n
        self.plan.views[r.id] = r
        self.plan.block_targets[r.id] = (r.blocks + need - r.cached_idle_blocks
                                         + r.cached_tokens // self.budget.block_size)

    def preempt(self, v: RequestView) -> None:
        # blocks other requests hold too (a shared cached prefix) stay in use
        self.free += self.plan.block_targets.pop(v.id, v.blocks) - v.shared_blocks
        self.tokens += self.plan.work.pop(v.id, 0)
        self.preempted_ids.add(v.id)
        self.plan.preempted.append(v)
        if self.budget.max_running:
            self.per_class[v.request_class] -= 1

    def victim_below(self, r: RequestView) -> RequestView | None:
        """The least deserving running request that deserves less than r, if any."""
        last = len(self.rank)
        mine = self.rank.get(r.id, last)
        while self.victims and self.victims[0].id in self.preempted_ids:
            self.victims.popleft()
        if not self.victims:
            return None
        v = self.victims[0]
        if v is r or self.rank.get(v.id, last) <= mine:
            return None
        return self.victims.popleft()

    def make_room(self, r: RequestView, need: int) -> None:
        """Preempt running requests below r until `need` blocks are free, but only if that
        can succeed: victims evicted for a request that then does not fit come straight back
        next iteration, and are evicted again (a swap ping-pong, issue 13)."""
        if need <= self.free or not self.budget.can_preempt:
            return
        last = len(self.rank)
        mine = self.rank.get(r.id, last)
        room = self.free + sum(
            self.plan.block_targets.get(v.id, v.blocks) - v.shared_blocks for v in self.victims
            if v is not r and v.id not in self.preempted_ids and self.rank.get(v.id, last) > mine)
        if room < need:
            return
        while need > self.free and self.budget.can_preempt:
            victim = self.victim_below(r)
            if victim is None:
                return
            self.preempt(victim)

    def running_pass(self) -> None:
        # once per running request per iteration: `full`, `remaining_tokens`, make_room's
        # first test, and `need` and `commit` without a prefix cache hit written out, since
        # each call costs about what the work does
        plan, preempted, seq_limit, bs = self.plan, self.preempted_ids, self.seq_limit, \
            self.budget.block_size
        work, views, targets = plan.work, plan.views, plan.block_targets
        for r in self.running:
            rid = r.id
            if rid in work or (preempted and rid in preempted):
                continue
            if len(work) >= seq_limit or self.tokens <= 0:
                return
            n = min(r.prompt_tokens + r.output_tokens - r.computed_tokens, self.tokens)
            cached = r.cached_tokens
            need = self.need(r, n) if cached else -(-(r.computed_tokens + n) // bs) - r.blocks
            if need > self.free and not self.budget.short_self:
                self.make_room(r, need)
            if need <= self.free:  # commit
                self.free -= need
                self.tokens -= n
                work[rid] = n
                views[rid] = r
                targets[rid] = r.blocks + need - r.cached_idle_blocks + cached // bs
            elif self.budget.can_preempt:
                self.preempt(r)
            else:
                self.blocked_without_preemption = True

    def class_full(self, r: RequestView) -> bool:
        """r's class already runs as many requests as its `max_running` allows."""
        limits = self.budget.max_running
        return bool(limits) and (self.per_class.get(r.request_class, 0)
                                 >= limits.get(r.request_class, 1 << 62))

    def admit(self, r: RequestView) -> None:
        self.plan.admitted.append(r)
        if self.budget.max_running:  # the only reader of per_class
            self.per_class[r.request_class] = self.per_class.get(r.request_class, 0) + 1

    def admission_pass(self, states: tuple[str, ...] = ("waiting", "swapped")) -> None:
        for r in self.order:
            if r.state not in states or r.id in self.preempted_ids:
                continue
            if self.full():
                return
            if self.class_full(r):
                continue
            swap_only = r.state == "swapped" and self.budget.async_swap_in
            n = min(r.remaining_tokens - r.cached_tokens, self.tokens)
            # an asynchronous swap-in takes only its KV's blocks now, but comes back only if it
            # could also compute as a synchronous one would: one that cannot grow when it lands
            # preempts itself, and comes back, and preempts itself (a ping-pong, issue 13)
            fits = self.need(r, n)
            need = self.need(r, 0) if swap_only else fits
            if self.displace:
                self.make_room(r, fits)
            if fits > self.free:
                return
            if swap_only:
                self.free -= need
                self.plan.block_targets[r.id] = need
            else:
                self.commit(r, n, need)
            if r.state == "swapped":
                self.plan.swapped_in.append(r)
            self.admit(r)

    def separate_phases(self) -> None:
        """vLLM V0 without chunked prefill (vllm-project/vllm vllm/core/scheduler.py,
        `Scheduler._schedule_default`, read at commit 0054e1fa0f8ac79f0524b6b1f4d7c02f9e37eca1):
        when nothing is swapped out, whole waiting prompts in order (`_schedule_prefills`) while
        they fit the token budget, the sequence cap counted with the running requests and the
        free blocks, the first that does not fit stopping it; only if none was taken, the
        running requests' decodes (`_schedule_running`, preempting from the end of the order),
        then swapped requests if nobody was preempted (`_schedule_swapped`). Differences: a
        prompt longer than the whole budget, which vLLM refuses (`prompt_limit`), is chunked
        here so that it still ends. vLLM keeps 1% of the blocks free when admitting a prompt
        (`BlockSpaceManagerV1.can_allocate`'s watermark): `watermark_blocks`."""
        if not any(r.state == "swapped" for r in self._requests):
            self.prompt_pass()
        if self.plan.work:
            return
        self.running_pass()
        if not self.plan.preempted:
            self.admission_pass(states=("swapped",))

    def prompt_pass(self) -> None:
        seqs = sum(1 for r in self._requests
                   if r.state == "running" and r.id not in self.preempted_ids)
        for r in self.order:
            if r.state != "waiting" or r.id in self.preempted_ids:
                continue
            if seqs + len(self.plan.work) >= self.seq_limit:
                return
            if self.class_full(r):
                continue
            n = r.remaining_tokens - r.cached_tokens
            if n > self.tokens:
                if self.plan.work:
                    return
                n = self.tokens  # longer than the whole budget: chunked (vLLM refuses it)
            need = self.need(r, n)
            if self.displace:
                self.make_room(r, need + self.budget.watermark_blocks)
            if need + self.budget.watermark_blocks > self.free:
                return
            self.commit(r, n, need)
            self.admit(r)

    def break_deadlock(self) -> None:
        """Nothing could run, yet running requests hold memory (they all wait for blocks and
        the policy forbids preemption): preempt the least deserving one anyway."""
        while self.victims and self.victims[0].id in self.preempted_ids:
            self.victims.popleft()
        if self.victims:
            self.preempt(self.victims.popleft())
            self.plan.forced = True


def plan_iteration(decision: Decision, requests: Sequence[RequestView], budget: Budget) -> IterationPlan:
    """Choose this iteration's work. `requests` are all live requests; `decision.order` the
    policy's ranking of (a subset of) them."""
    p = _Planner(decision, requests, budget)
    steps = (p.separate_phases,) if budget.separate_prefill else (p.running_pass, p.admission_pass)
    for step in steps:
        step()
    if p.blocked_without_preemption and not p.plan.work:
        p.break_deadlock()
        for step in steps:
            step()
    return p.plan
