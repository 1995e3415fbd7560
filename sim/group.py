"""A simulated instance serving as the head of a KunServe pipeline group (§4.1-4.3).

While grouped, the head's runner runs each step as a pipeline over the group's members (member
i runs its layers, a share of every microbatch's cost). KunServe keeps as many microbatches in
flight as there are stages, across iterations (§4.3, Figure 8), so a step is one round of K
microbatches through K stages and its time is the steady-state period of that round:
    period = max( max_m [cost_m + (K-1) x activation_m + link wait],  max_s sum_m cost[s][m] )
a microbatch's own trip through every stage (it cannot start its next iteration before its
token is sampled) or the busiest stage's work, whichever is longer. Unbalanced microbatches
make the first term win and leave stages idle: the bubble ratio (1 - work / (K x period))
that lookahead formation (engine/cluster/lookahead.py) shrinks. A sequence cut across
microbatches whose token is sampled this step can add a third term (`GroupNetwork.chain`):
its last piece enters stage 0 only after the microbatches before it left stage 0, then makes its
trip (`_chain_s`); without it such a prompt gets K stages' compute in one period.
Assumed, as in sim/pipeline.py: a stage's cost is the whole model's cost times its layer share.

The microbatches are cut by token count, prefills chunked to fill them (`microbatch tokens`), or
by the Eq. 1-3 model fitted per stage by least squares at group entry (`microbatch lookahead`); the
fit's error on held-out batches is recorded. Activations wait behind exchanged KV as
sim/exchange.py says.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import anyio
import attrs

from engine.cluster.drop_plan import GroupPlan
from engine.cluster.lookahead import (
    TOKEN_COUNT,
    ChunkCost,
    TokenLine,
    fit_chunk_cost,
    fit_token_line,
    lookahead_split,
)
from engine.cluster.plan import PipelineTotals
from engine.cost_model import BatchShape, CostModel
from engine.messages import ExecuteStep, SampledToken, StepFinished
from sim.exchange import SimExchange, group_wait
from sim.network import NetworkLink
from sim.profile import ModelShape

MIN_CHUNK_TOKENS = 32
"""Lookahead never cuts a prefill into a piece smaller than this (§4.3, Figure 11 line 4-5:
generation halts below a threshold; 32 tokens keeps a piece's GEMM reasonably shaped)."""


@attrs.define
class FitReport:
    stages: int
    samples: int
    mean_error: float
    """Mean |predicted - true| / true over held-out microbatches, per stage, averaged."""
    max_error: float
    tokens_model_error: float
    """The same for a token-count model (ms = a + b x tokens, also least squares)."""


@attrs.define
class GroupNetwork:
    """What a head's runner needs to run as a group (set on the runner by the cluster)."""

    link: NetworkLink
    model: ModelShape
    microbatch: str = "tokens"
    exchanges: list[SimExchange] = attrs.field(factory=list)
    totals: PipelineTotals = attrs.field(factory=PipelineTotals)
    """What the head's pipeline did while grouped, summed over steps (the bench's bubble ratio)."""
    full: PipelineTotals = attrs.field(factory=PipelineTotals)
    """The same over the steps with work for a microbatch per stage (where formation can
    balance anything: a step of fewer microbatches than stages idles stages whatever the
    split, e.g. a few decodes while the group drains)."""
    fits: list[FitReport] = attrs.field(factory=list)
    errors: list[float] = attrs.field(factory=list)
    """|Eq. 1-3 prediction - profile cost| / profile cost of every microbatch a lookahead group
    ran (stage 0), the in-run counterpart of `FitReport.mean_error`."""
    token_errors: list[float] = attrs.field(factory=list)
    """The same for the token-count model fitted beside it."""
    paper_errors: list[float] = attrs.field(factory=list)
    """The same for Eq. 1 as published (one prefix-attention coefficient for decodes too),
    fitted beside it, when the split uses the decode term."""
    decode_term: bool = True
    """Lookahead splits by Eq. 1-3 with a decode's context priced apart
    (engine/cluster/lookahead.py `ChunkCost.alpha_decode`); False: Eq. 1 as published."""
    chain: bool = False
    """True: a sequence cut across microbatches that samples this step holds the step until
    its last piece is through (`SimGroup._chain_s`): its first token exact, the rest of the
    step (and the next) held with it, so throughput is a lower bound (a real pipeline starts
    the next round's first microbatch meanwhile). False (default): every token at the
    steady-state period: throughput exact, such a prompt's first token early by up to
    (pieces - 1) stage-0 times (a 4,096-token prompt on 2 A10 stages: 0.45 s, not 0.65 s).
    The bench's --chain runs the bound (bench/kunserve.py)."""
    chain_steps: int = 0
    """Steps whose time that wait set (longer than the steady-state period)."""
    chain_extra_s: float = 0.0
    """The time it added over those steps."""
    block_size: int = 16
    computed: dict[int, int] = attrs.field(factory=dict)
    """The head's record of each live request's tokens whose KV every member wrote, from the
    grouped steps it sent (as the torch head keeps it, gpu/restore_kv.py `note_step`): what a
    restore moves is counted from it (shunter/cluster/sim_restore.py)."""
    named: dict[int, int] | None = None
    """While a restore prefetch runs: request -> its leading full blocks sent to the head so
    far (a request reset or released since is forgotten)."""
    on_fill: Callable[[int], None] | None = None
    """While a restore prefetch runs: told the blocks each grouped step fills beyond `named`
    (they go to the head behind the step's activations)."""
    noted: int = 0
    """Grouped steps noted so far (`note_step`)."""
    _stepped: anyio.Event | None = None
    stepped_until: float = 0.0
    """When the group's last step ends: where a one-step restore's copies can begin."""
    hold_until: float = 0.0
    """A `restore_prefetch off` restore (shunter/cluster/sim_restore.py): the head's first step
    alone starts no earlier, its copies over every link landing first; moved by `hold_to` (a
    member lost before they landed: the head's own reload from its host copy instead,
    shunter/cluster/sim_faults.py)."""
    hold_why: str = "restore"
    restore_stalls: list[float] = attrs.field(factory=list)
    """Virtual seconds the head's first step alone waited for them, one per such restore."""
    fault_holds: list[float] = attrs.field(factory=list)
    """The same for a hold a fault moved (its reload, not a restore's copies)."""
    _moved: anyio.Event | None = None
    loaded_at: float = 0.0
    """A merged group's members load the layers they gain from their host copies (as torch's
    members do at a re-split, gpu/kept_kv.py): its grouped steps start no earlier
    (shunter/cluster/sim_formation.py `merge_load_s`)."""
    load_waits: list[float] = attrs.field(factory=list)
    """Virtual seconds grouped steps waited for it, one per step that waited."""

    def hold_to(self, until: float, why: str) -> None:
        """The head's first step alone waits until `until` (a waiter already holding follows)."""
        self.hold_until, self.hold_why = until, why
        if self._moved is not None:
            self._moved.set()
            self._moved = None

    async def held(self) -> float:
        """Until `hold_until`, following any `hold_to` meanwhile; the seconds waited."""
        began = anyio.current_time()
        while (wait := self.hold_until - anyio.current_time()) > 0:
            if self._moved is None:
                self._moved = anyio.Event()
            with anyio.move_on_after(wait):
                await self._moved.wait()
        return anyio.current_time() - began

    def note_step(self, step: ExecuteStep) -> int:
        """A grouped step as the head sends it: its requests' tokens computed once it ran;
        returns the blocks it fills beyond `named` while a restore prefetch runs (they go
        behind its activations: `fill`)."""
        named = self.named
        for u in step.blocks:
            if u.reset:
                self.computed.pop(u.request_id, None)
                if named is not None:
                    named.pop(u.request_id, None)
        for rid in step.release:
            self.computed.pop(rid, None)
            if named is not None:
                named.pop(rid, None)
        filled = 0
        for w in step.seqs:
            c = self.computed[w.request_id] = w.start + w.num_tokens
            if named is not None and (hi := c // self.block_size) > named.get(w.request_id, 0):
                filled += hi - named.get(w.request_id, 0)
                named[w.request_id] = hi
        self.noted += 1
        if self._stepped is not None:
            self._stepped.set()
            self._stepped = None
        return filled

    def fill(self, blocks: int) -> None:
        if blocks and self.on_fill is not None:
            self.on_fill(blocks)

    async def stepped(self, since: int, timeout: float) -> bool:
        """Whether a grouped step was noted after the first `since`, waiting up to `timeout`."""
        if self.noted <= since:
            if self._stepped is None:
                self._stepped = anyio.Event()
            with anyio.move_on_after(timeout):
                await self._stepped.wait()
        return self.noted > since

    async def hold(self) -> None:
        """Called by the runner at its first step alone again: waits out `hold_until`."""
        waited = await self.held()
        if waited > 0:
            (self.restore_stalls if self.hold_why == "restore" else self.fault_holds).append(waited)


@attrs.frozen
class StageFit:
    fit: ChunkCost
    mean_error: float
    max_error: float
    tokens_error: float
    tokens_line: TokenLine
    paper_fit: ChunkCost
    """Eq. 1 as published, fitted on the same samples."""


def fit_stage(cost: CostModel, share: float, *, seed: int, samples: int = 96,
              decode_term: bool = True) -> StageFit:
    """Eq. 1-3 for one stage, by least squares over random microbatches timed by the profile
    (the simulator's ground truth), and its error on as many held-out ones; also the error of a
    token-count model fitted the same way, and that model (intercept, ms per token)."""
    rng = random.Random(seed)

    def batch() -> list[tuple[int, int]]:
        out = []
        for _ in range(rng.randint(1, 48)):
            if rng.random() < 0.75:
                out.append((rng.randint(16, 4096), 1))
            else:
                out.append((rng.choice([0, rng.randint(0, 4096)]), rng.randint(2, 2048)))
        return out

    def truth(b: list[tuple[int, int]]) -> float:
        return cost.predict_ms(BatchShape.of(b)) * share

    train = [(b, truth(b)) for b in (batch() for _ in range(samples))]
    test = [(b, truth(b)) for b in (batch() for _ in range(samples))]
    fit = fit_chunk_cost(train, decode_term=decode_term)
    errs = [abs(fit.batch_ms(b) - t) / t for b, t in test]
    tokens = fit_token_line(train)
    tok_errs = [abs(tokens.batch_ms(b) - t) / t for b, t in test]
    return StageFit(fit=fit, mean_error=sum(errs) / len(errs), max_error=max(errs),
                    tokens_error=sum(tok_errs) / len(tok_errs), tokens_line=tokens,
                    paper_fit=fit_chunk_cost(train) if decode_term else fit)


class SimGroup:
    def __init__(self, plan: GroupPlan, cost: CostModel, net: GroupNetwork,
                 token_id: int) -> None:
        self.plan = plan
        self.cost = cost
        self.net = net
        self.token_id = token_id
        layers = net.model.num_layers
        self.shares = [len(r) / layers for r in plan.layers]
        self._token_bytes = net.model.hidden_size * net.model.dtype_bytes
        self.fit: ChunkCost | None = None
        self._paper_fit: ChunkCost | None = None
        self._tokens_fit = TokenLine(intercept=0.0, per_token=0.0)
        if net.microbatch == "lookahead":
            fits = [fit_stage(cost, share, seed=s, decode_term=net.decode_term)
                    for s, share in enumerate(self.shares)]
            self.fit = fits[0].fit  # stage costs are proportional here: one shape splits all
            self._paper_fit = fits[0].paper_fit if net.decode_term else None
            self._tokens_fit = fits[0].tokens_line
            net.fits.append(FitReport(
                stages=len(fits), samples=96,
                mean_error=sum(f.mean_error for f in fits) / len(fits),
                max_error=max(f.max_error for f in fits),
                tokens_model_error=sum(f.tokens_error for f in fits) / len(fits)))

    def _microbatches(self, step: ExecuteStep) -> list[list[tuple[int, int, int]]]:
        """K microbatches of (sequence, start, tokens), in the order they enter stage 0: by the
        fitted Eq. 1-3 costs (lookahead), or by token count with prefills chunked to fill them
        (Sarathi/vLLM's token budget, §4.3 Figure 9). A sequence cut in two has its earlier
        piece in the earlier microbatch."""
        k = len(self.shares)
        chunks = [(i, w.start, w.num_tokens) for i, w in enumerate(step.seqs)]
        if self.fit is None:  # a token budget per microbatch: what does not fit waits
            return lookahead_split(chunks, k, TOKEN_COUNT, min_tokens=MIN_CHUNK_TOKENS,
                                   fill=True)
        return lookahead_split(chunks, k, self.fit, min_tokens=MIN_CHUNK_TOKENS)

    def _chain_s(self, step: ExecuteStep, keyed: list[list[tuple[int, int, int]]],
                 costs: list[float], trips: list[float]) -> float:
        """The longest wait for a token of a sequence cut across microbatches: it is sampled
        when the last piece leaves the last stage, and that piece enters stage 0 only after the
        microbatches before it have left stage 0 (it attends to the earlier pieces' KV; stage 0
        runs one microbatch at a time). Only sequences that sample this step count: a piece
        with no token after it is waited for by nothing in the steady state. 0 when none."""
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for m, mb in enumerate(keyed):
            for key, _, _ in mb:
                first.setdefault(key, m)
                last[key] = m
        entry = [0.0]
        for c in costs[:-1]:
            entry.append(entry[-1] + c * self.shares[0])
        return max((entry[last[q]] - entry[first[q]] + trips[last[q]] for q in first
                    if last[q] > first[q] and step.seqs[q].sample), default=0.0)

    async def step(self, step: ExecuteStep) -> StepFinished:
        if (load := self.net.loaded_at - anyio.current_time()) > 0:  # a merge's gained layers
            await anyio.sleep(load)
            self.net.load_waits.append(load)
        now = anyio.current_time()
        filled = self.net.note_step(step)
        keyed = self._microbatches(step) if step.seqs else []
        micro = [[(s, n) for _, s, n in mb] for mb in keyed]
        k = len(self.shares)
        costs = [self.cost.predict_ms(BatchShape.of(mb)) / 1e3 for mb in micro]
        acts = [self.net.link.send_s(sum(n for _, n in mb) * self._token_bytes) for mb in micro]
        period = 0.0
        if micro:
            wait = group_wait(self.net.exchanges, now)
            trips = [c + (k - 1) * a + wait for c, a in zip(costs, acts)]
            loads = [share * sum(costs) for share in self.shares]
            period = max(max(trips), max(loads))
            chain = self._chain_s(step, keyed, costs, trips) if self.net.chain else 0.0
            if chain > period:
                self.net.chain_steps += 1
                self.net.chain_extra_s += chain - period
                period = chain
            for x in self.net.exchanges:
                x.note_activations(now, sum(acts))
            self.net.fill(filled)  # (the blocks it fills follow its activations)
            t = self.net.totals
            t.steps += 1
            t.makespan_s += period
            t.busy_s += sum(loads)
            t.stage_s += k * period
            t.transfer_s += sum(acts)
            t.microbatches += len(micro)
            if len(micro) == k:
                f = self.net.full
                f.steps += 1
                f.makespan_s += period
                f.busy_s += sum(loads)
                f.stage_s += k * period
            if self.fit is not None:
                self._note_errors(micro, costs)
            self.net.stepped_until = now + period
            await anyio.sleep(period)
        sampled = tuple(SampledToken(request_id=w.request_id, token_id=self.token_id)
                        for w in step.seqs if w.sample)
        return StepFinished(step_id=step.step_id, sampled=sampled, compute_s=period)


    def _note_errors(self, micro: list[list[tuple[int, int]]], costs: list[float]) -> None:
        for mb, c in zip(micro, costs):
            truth = c * 1e3 * self.shares[0]
            self.net.errors.append(abs(self.fit.batch_ms(mb) - truth) / truth)
            self.net.token_errors.append(abs(self._tokens_fit.batch_ms(mb) - truth) / truth)
            if self._paper_fit is not None:
                self.net.paper_errors.append(abs(self._paper_fit.batch_ms(mb) - truth) / truth)


def enter_group(plan: GroupPlan, cost: CostModel, net: GroupNetwork | None,
                token_id: int) -> SimGroup | None:
    """The runner's mode from this step: a group (None: alone again)."""
    if plan.size == 1:
        return None
    if net is None:
        raise RuntimeError("this simulated instance was asked to head a pipeline group but its "
                           "cluster gave it no network (sim/group.py GroupNetwork)")
    net.computed.clear()  # (the torch head's record is its group runner's)
    return SimGroup(plan, cost, net, token_id)
