"""The test's stand-in for the engines over two torch instance processes (tests/gpu/
kunserve_host.py): a plain greedy scheduler per instance (a block free list, prefill then one
decode token a step), and the group moves of KunServe driven by hand: drop, adopt, exchange,
pipelined steps, restore. It drives the runners directly, not through Engine/Cluster."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import time
from collections.abc import Iterator, Sequence

import attrs

from engine.cluster.drop_plan import GroupPlan
from engine.messages import BlockUpdate, ExecuteStep, RequestSetup, SeqWork
from engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0)
EOS_ID = 1


@attrs.define(eq=False)
class Req:
    name: str
    prompt: list[int]
    max_tokens: int
    rid: int
    out: list[int] = attrs.Factory(list)
    table: list[int] = attrs.Factory(list)
    computed: int = 0
    fresh: bool = True
    """The runner has not been told about it yet (a setup goes with its next step)."""
    ready: bool = True
    sampling: SamplingParams = GREEDY
    reset: bool = False
    """Its KV was lost: recompute it (the runner still has its tokens)."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def done(self) -> bool:
        """max_tokens reached, or <|eos|> (id 1 in gpu/make_model.py's models) sampled."""
        return len(self.out) >= self.max_tokens or (bool(self.out) and self.out[-1] == EOS_ID)


class Host:
    def __init__(self, ctx, rank: int, world: int, init: str, model_dir, num_blocks: int,
                 block_size: int) -> None:
        from tests.gpu.kunserve_host import host_main

        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=host_main, args=(rank, world, init, str(model_dir),
                                                        num_blocks, block_size, child),
                                daemon=True)
        self.proc.start()
        child.close()

    def call(self, *msg, timeout: float = 120.0):
        self.conn.send(msg)
        return self.answer(timeout)

    def answer(self, timeout: float = 120.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"instance pid {self.proc.pid} did not answer")
        kind, value = self.conn.recv()
        if kind != "ok" and kind != "ready":
            raise RuntimeError(f"instance pid {self.proc.pid}: {kind}: {value}")
        return value


def start_hosts(model_dir, num_blocks: int, block_size: int, n: int = 2) -> list[Host]:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hosts = [Host(ctx, r, n, f"tcp://127.0.0.1:{port}", model_dir, num_blocks, block_size)
             for r in range(n)]
    return hosts


def running_hosts(model_dir, num_blocks: int, block_size: int,
                  n: int) -> Iterator[tuple[list[Host], list[range]]]:
    """A fixture's body: `n` instance processes and each one's pool, stopped afterwards."""
    hosts = start_hosts(model_dir, num_blocks, block_size, n=n)
    ranges = [range(*h.answer(timeout=180)) for h in hosts]
    yield hosts, ranges
    for h in hosts:
        if h.proc.is_alive():
            h.conn.send(("stop",))
        h.proc.join(timeout=10)
        if h.proc.is_alive():
            h.proc.kill()


def hosts_with_env(model_dir, num_blocks: int, block_size: int, n: int, env: str,
                   value: str) -> Iterator[tuple[list[Host], list[range]]]:
    """`running_hosts` with `env` set to `value` while the processes start (a test fault they
    read: gpu/data_plane.py FAULT_ENV, gpu/group_stage.py STEP_FAULT_ENV, ...)."""
    os.environ[env] = value
    try:
        gen = running_hosts(model_dir, num_blocks, block_size, n=n)
        started = next(gen)
    finally:
        del os.environ[env]
    yield started
    next(gen, None)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 320) for _ in range(n)]


def solo_steps(pairs: Sequence[tuple[Host, Scheduler]], steps: int) -> None:
    """`steps` solo steps on each (host, scheduler), the instances stepping side by side."""
    for _ in range(steps):
        sent = []
        for host, sched in pairs:
            step = sched.next_step()
            host.conn.send(("step", step))
            sent.append((host, sched, step))
        for host, sched, step in sent:
            done, _ = host.answer()
            sched.finish(step, done.sampled)


class Scheduler:
    """One engine's bookkeeping: its pool (block ids), its requests, its next step."""

    def __init__(self, pool: range, block_size: int) -> None:
        self.block_size = block_size
        self.free = list(reversed(pool))
        self.reqs: dict[int, Req] = {}
        self.release: list[int] = []
        self.step_id = 0

    def grow(self, pool: range) -> None:
        held = {b for r in self.reqs.values() for b in r.table}
        self.free = [b for b in reversed(pool) if b not in held]

    def shrink(self, pool: range) -> tuple[tuple[int, int], ...]:
        """The pool becomes `pool` again: every held block above it moves to a free one inside
        (the engine's BlockPool.resize does the same); returns the (src, dst) moves."""
        held = {b for r in self.reqs.values() for b in r.table}
        free = [b for b in reversed(pool) if b not in held]
        moves = []
        for r in self.reqs.values():
            for i, b in enumerate(r.table):
                if b >= pool.stop:
                    r.table[i] = free.pop()
                    moves.append((b, r.table[i]))
        self.free = free
        return tuple(moves)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def fits(self, req: Req) -> bool:
        return self.blocks_for(len(req.tokens) + req.max_tokens) <= len(self.free)

    def add(self, req: Req) -> None:
        self.reqs[req.rid] = req

    def next_step(self) -> ExecuteStep:
        setups, blocks, seqs = [], [], []
        for r in self.reqs.values():
            if r.done or not r.ready:
                continue
            if r.fresh:
                setups.append(RequestSetup(request_id=r.rid, prompt_ids=tuple(r.tokens),
                                           sampling=r.sampling, eos_token_ids=()))
                r.fresh = False
            n = len(r.tokens) - r.computed
            need = self.blocks_for(r.computed + n) - len(r.table)
            new = [self.free.pop() for _ in range(max(0, need))]
            if new or r.reset:
                r.table += new
                blocks.append(BlockUpdate(request_id=r.rid, reset=r.reset, append=tuple(new)))
                r.reset = False
            seqs.append(SeqWork(request_id=r.rid, start=r.computed, num_tokens=n, sample=True))
        self.step_id += 1
        step = ExecuteStep(step_id=self.step_id, release=tuple(self.release),
                           setups=tuple(setups), blocks=tuple(blocks), seqs=tuple(seqs))
        self.release = []
        return step

    def finish(self, step: ExecuteStep, sampled: Sequence) -> None:
        got = {t.request_id: t.token_id for t in sampled}
        for w in step.seqs:
            r = self.reqs[w.request_id]
            assert w.request_id in got, f"{r.name} got no token in step {step.step_id}"
            r.computed += w.num_tokens
            r.out.append(got[w.request_id])
            if r.done:
                self.free += r.table
                r.table = []
                self.release.append(r.rid)

    def live(self) -> list[Req]:
        return [r for r in self.reqs.values() if not r.done]


def run_alone(pairs: Sequence[tuple[Host, Scheduler]], max_steps: int = 200) -> None:
    """Solo steps until every request of every (host, scheduler) is done, then one more that
    hands each runner its last releases. Fails at once, naming them, when the requests left
    are none of them ready (none would be stepped: the run would never end), and after
    `max_steps`."""
    for _ in range(max_steps):
        busy = [(h, s) for h, s in pairs if any(not r.done for r in s.reqs.values())]
        if not busy:
            break
        left = [r for _, s in busy for r in s.reqs.values() if not r.done]
        assert any(r.ready for r in left), f"no request left can be stepped: {left_of(left)}"
        solo_steps(busy, 1)
    else:
        raise AssertionError(f"not done after {max_steps} solo steps: "
                             f"{left_of([r for _, s in pairs for r in s.live()])}")
    solo_steps(pairs, 1)


def left_of(reqs: Sequence[Req]) -> str:
    """Requests as a failure names them: name, ready, tokens computed, tokens out of max."""
    return ", ".join(f"{r.name} (ready {r.ready}, computed {r.computed}, out "
                     f"{len(r.out)}/{r.max_tokens})" for r in reqs)


def group_step(head: Host, sched: Scheduler, step: ExecuteStep | None = None):
    """One group step (the scheduler's next one if `step` is None): its tokens to the
    scheduler, and every request whose KV the step's answer says arrived on every member
    marked ready (only then does the scheduler step it). Returns the answer's StepFinished."""
    step = sched.next_step() if step is None else step
    done, arrived = head.call("step", step)
    sched.finish(step, done.sampled)
    for rid in arrived:
        if rid in sched.reqs:
            sched.reqs[rid].ready = True
    return done


def fail_a_victims_step(head: Host, sched: Scheduler, block: int):
    """Group steps with only the live request with the most tokens left (the others held back)
    until one, which fills a block of it, fails (a test fault makes it). Returns the victim,
    the requests held back, that step and its error; fails if no step within a block did."""
    live = sched.live()
    victim = max(live, key=lambda r: r.max_tokens - len(r.out))
    assert len(live) >= 2 and victim.max_tokens - len(victim.out) > block + 1, left_of(live)
    others = [r for r in live if r is not victim]
    for r in others:
        r.ready = False
    for _ in range(block + 1):
        step = sched.next_step()
        try:
            group_step(head, sched, step)
        except RuntimeError as exc:
            return victim, others, step, str(exc)
    raise AssertionError("no step filled a block of the victim: the fault never fired")


def end_the_failed(sched: Scheduler, victim: Req, others: Sequence[Req]) -> None:
    """As the engine: the failed step's request ends with its error and is released; the
    requests held back for it run again."""
    sched.free += victim.table
    victim.table = []
    sched.release.append(victim.rid)
    del sched.reqs[victim.rid]
    for r in others:
        r.ready = True


def all_ready(sched: Scheduler) -> bool:
    """Every live request's KV is in (its exchange arrived on every member)."""
    return all(r.ready for r in sched.live())


def group_steps(head: Host, sched: Scheduler, until) -> int:
    """Group steps until `until()` and every live request's KV arrived (a request still
    waiting for it is never stepped: anything after this assumes none waits); returns how
    many had work. Empty steps (every request still waits for its KV: they ask the members
    for arrivals) do not count, however many the exchange takes under load; the KV must come
    within 60 s."""
    n, waiting_since = 0, time.monotonic()
    while not (until() and all_ready(sched)):
        step = sched.next_step()
        group_step(head, sched, step)
        if step.seqs:
            n, waiting_since = n + 1, time.monotonic()
        assert time.monotonic() - waiting_since < 60, \
            f"no request's KV arrived in 60 s: {left_of(sched.live())}"
        assert n < 60, f"the group never got there: {left_of(sched.live())}"
    return n


def form_group(model_dir, head: Host, sched: Scheduler, ranks, adopted, solo: range,
               layers: tuple[range, ...]) -> range:
    """The head's engine grows its pool to the group's and its next step carries the plan
    (ExecuteStep.group, .pool_blocks: K1's engine fields); returns the group's block ids."""
    import torch

    from gpu.config import ModelConfig
    from gpu.stage_view import group_pool_blocks

    config = ModelConfig.from_dir(model_dir)
    pool = range(solo.start, solo.start + group_pool_blocks(
        config, sched.block_size, torch.float32, solo.stop, layers))
    head.call("expect_adopted", tuple(adopted))
    sched.grow(pool)
    for r in sched.live():  # the head's own requests wait for their KV on the member too
        r.ready = False
    step = attrs.evolve(sched.next_step(), group=GroupPlan(group_id=1, members=tuple(ranks),
                                                            layers=layers),
                        pool_blocks=len(pool))
    group_step(head, sched, step)
    return pool


def adopt_live(head: Scheduler, member: Scheduler, owner: int = 1):
    """The member's live requests as the head adopts them (new ids: 100 + the old one, no KV
    yet): added to the head's scheduler. Returns (the (member's, head's) pairs, their
    `Adopted` entries for `form_group`)."""
    from gpu.group_messages import Adopted

    moved, adopted = [], []
    for r in member.live():
        new = Req(r.name, r.prompt, r.max_tokens, rid=100 + r.rid, out=list(r.out),
                  computed=r.computed, ready=False)
        adopted.append(Adopted(request_id=new.rid, owner=owner, old_request_id=r.rid,
                               kv_tokens=r.computed))
        moved.append((r, new))
    for _, new in moved:
        head.add(new)
    return moved, adopted


def restored_kv_is_a_prefill(h0, h1, s0: Scheduler, solo1: range) -> None:
    """Every live request's KV on the head after the restore equals a prefill of its computed
    tokens on instance 1 (alone again): a block restored stale (prefetched, then changed) or
    not at all differs by far more than the float order of pipelined decoding."""
    import torch

    s1 = Scheduler(solo1, s0.block_size)
    for r in s0.live():
        got = h0.call("kv", r.rid, r.computed)
        ref = Req(f"{r.name} prefill", r.tokens[:r.computed], 1, rid=900 + r.rid)
        s1.add(ref)
        solo_steps([(h1, s1)], 1)
        want = h1.call("kv", ref.rid, r.computed)
        diff = (got - want).abs().amax(dim=(1, 2, 3, 4))  # per token
        assert torch.allclose(got, want, atol=1e-4), \
            f"{r.name}: restored KV differs from a prefill at tokens " \
            f"{torch.nonzero(diff > 1e-4).flatten().tolist()} of {r.computed}"
    solo_steps([(h1, s1)], 1)  # hands the runner the releases
