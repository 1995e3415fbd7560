"""The simulator's step runner: the `StepRunner` interface of `gpu.runner.TorchRunner`, with no
tensors. A step sleeps for the time the profile's cost model predicts for its batch (after
waiting for the swaps it depends on) and samples a fixed token for every sequence that asks."""

from __future__ import annotations

import anyio

from engine.cost_model import BatchShape, CostModel
from engine.messages import ExecuteStep, SampledToken, StepFinished
from sim.group import GroupNetwork, SimGroup, enter_group
from sim.profile import CopyContention, CopyLink, EngineCost, ModelShape
from sim.swap import SimSwapper

SIM_TOKEN_ID = 1
"""What every simulated sample returns (the simulator has no logits)."""


class SimRunner:
    GROUP_MODES = ("fifo", "coordinated", "tokens", "lookahead", "restore_prefetch on",
                   "restore_prefetch off", "restore_from peer", "restore_from host")
    """KunServe group settings it honours (sim/group.py, sim/exchange.py; the restore's:
    shunter/cluster/sim_restore.py)."""

    def __init__(self, cost: CostModel, num_blocks: int, *, token_id: int = SIM_TOKEN_ID,
                 link: CopyLink | None = None, model: ModelShape | None = None,
                 block_size: int = 16, engine_cost: EngineCost | None = None,
                 contention: CopyContention | None = None) -> None:
        self.cost = cost
        self.engine_cost = engine_cost
        """The engine's own time around each step (issue 18), slept before and after it."""
        self.engine_s = 0.0
        """Simulated seconds charged for it."""
        self.contention = contention
        """What swap copies overlapping a step and the engine's time around it add to them
        (a CPU backend's copies share its cores), slept after the step."""
        self.contention_s = 0.0
        """Simulated seconds charged for it."""
        self.num_blocks = num_blocks
        self.token_id = token_id
        self.steps = 0
        self.busy_s = 0.0
        """Simulated seconds spent in steps (device utilisation = busy_s / elapsed)."""
        self._link = link
        self._model = model
        self._block_size = block_size
        self._tables: dict[int, list[int]] = {}
        self.swapper: SimSwapper | None = None
        self._overlap_end = 0.0
        self._transfers = 0  # the swapper's transfers charged for so far
        self.network: GroupNetwork | None = None
        """Set by a simulated cluster: what this runner needs to head a KunServe group."""
        self.group: SimGroup | None = None
        """When the slot copies the current step overlaps end (BROS §4.1: max(model, copy))."""

    async def start(self) -> range:
        return range(self.num_blocks)

    async def make_swapper(self, num_host_blocks: int) -> SimSwapper:
        if self._link is None or self._model is None:
            raise RuntimeError("this simulated runner has no copy link to swap over")
        self.swapper = SimSwapper(self._link, block_nbytes=self._model.block_bytes(self._block_size),
                                  num_layers=self._model.num_layers, block_size=self._block_size,
                                  track_busy=self.contention is not None,
                                  start_lag_s=(self.engine_cost.copy_start_ms / 1000.0
                                               if self.engine_cost is not None else 0.0),
                                  pickup_s=(self.engine_cost.copy_pickup_ms / 1000.0
                                            if self.engine_cost is not None else 0.0))
        return self.swapper

    async def step(self, step: ExecuteStep) -> StepFinished:
        if step.group is not None:  # KunServe: a pipeline group from this step (or alone again)
            self.group = enter_group(step.group, self.cost, self.network, self.token_id)
            if self.group is None and self.network is not None:  # a one-step restore's copies
                await self.network.hold()
        if self.group is not None:
            done = await self.group.step(step)
            self.steps, self.busy_s = self.steps + 1, self.busy_s + done.compute_s
            return done
        # BatchShape.of, without a generator: this runs once per iteration of a replayed hour
        pt = psq = ppre = ds = dc = 0
        sampled = []
        tok, new = self.token_id, tuple.__new__
        for w in step.seqs:
            n = w.num_tokens
            if n == 1:
                ds += 1
                dc += w.start + 1
            else:
                pt += n
                psq += n * n
                ppre += n * w.start
            if w.sample:
                sampled.append(new(SampledToken, (w.request_id, tok)))  # its fields in order
        shape = BatchShape(prefill_tokens=pt, prefill_sq=psq, prefill_prefix=ppre,
                           decode_seqs=ds, decode_context=dc)
        seconds = self.cost.predict_ms(shape) / 1000.0 if step.seqs else 0.0
        after = 0.0
        contend = self.contention if self.swapper is not None else None
        extra = 0.0
        if self.engine_cost is not None and step.seqs:
            around = self.engine_cost.ms(len(step.seqs), len(sampled)) / 1000.0
            before = around * self.engine_cost.before_share
            after = around - before
            self.engine_s += around
            began = anyio.current_time() if contend is not None else 0.0
            await anyio.sleep(before)
            if contend is not None:
                extra += contend.engine * self._copying_since(began)
        # after the engine's work before the step, as on a real engine: the swaps issued with
        # this step's plan copy while the plan travels to the device (through the swap pool,
        # which issues them: `EngineCost.swap_ms`), which then waits for what is left of them
        stall = 0.0
        if self.swapper is not None:
            if self.engine_cost is not None:
                issued, self._transfers = self.swapper.transfers - self._transfers, self.swapper.transfers
                dispatch = self.engine_cost.swap_ms(issued) / 1000.0
                if dispatch > 0:
                    self.engine_s += dispatch
                    await anyio.sleep(dispatch)
            stall = await self._wait_for_swaps(step)
            if (failed := self.swapper.failed(step.wait_tickets)) is not None:  # as on torch:
                await anyio.sleep(max(0.0, failed[2] - anyio.current_time()))  # once it raised
                raise RuntimeError(f"swap ticket {failed[0]} failed: {failed[1]}")
        if seconds > 0 and contend is not None and step.wait_tickets:  # reads KV just copied
            seconds += contend.swapped_in_ms * len(step.wait_tickets) / 1000.0
        if seconds > 0 and self.swapper is not None:  # its inputs in, its tokens out
            wait_in = self._own_copy_wait("in", 0.0)
            seconds += wait_in + self._own_copy_wait("out", wait_in + seconds)
        if seconds > 0:
            began = anyio.current_time() if contend is not None else 0.0
            await anyio.sleep(seconds)
            if contend is not None:
                extra += contend.step * self._copying_since(began)
        if self.swapper is not None:
            stall += await self._wait_for_overlapped()
        if after > 0:
            began = anyio.current_time() if contend is not None else 0.0
            await anyio.sleep(after)
            if contend is not None:
                extra += contend.engine * self._copying_since(began)
        if extra > 0:  # one pass: copying during this extra time is not charged again
            self.contention_s += extra
            await anyio.sleep(extra)
        self.steps += 1
        self.busy_s += seconds
        return StepFinished(step_id=step.step_id, sampled=tuple(sampled), compute_s=seconds,
                            stall_s=stall)

    def _copying_since(self, began: float) -> float:
        """Seconds of swap copying between `began` and now (sim/copy_engine.py)."""
        assert self.swapper is not None
        return self.swapper.engine.busy_s(began, anyio.current_time())

    def _own_copy_wait(self, direction: str, after_s: float) -> float:
        """How long the step's own copy in `direction`, issued `after_s` into the step, waits
        behind swap copies (FastSwitch §3.2, bounded dispatch; sim/copy_engine.py)."""
        assert self.swapper is not None
        return self.swapper.engine.step_copy(anyio.current_time() + after_s, direction)  # type: ignore[arg-type]

    async def _wait_for_swaps(self, step: ExecuteStep) -> float:
        tables = self._tables
        for rid in step.release:
            tables.pop(rid, None)
        for u in step.blocks:
            table = tables.setdefault(u.request_id, [])
            if u.reset:
                table.clear()
            table.extend(u.append)
        bs = self._block_size
        written = [b for w in step.seqs for b in tables.get(w.request_id, [])[w.written(bs)]
                   ] if self.swapper.blocks_busy() else []
        now = anyio.current_time()
        self._overlap_end = self.swapper.overlapped_until(step.wait_tickets, written)
        stall = max(0.0, self.swapper.ready_at(step.wait_tickets, written) - now)
        if stall > 0 and self.engine_cost is not None:  # the device thread wakes after them
            stall += self.engine_cost.wake_ms / 1000.0
        if stall > 0:
            self.swapper.add_stall(stall)
            await anyio.sleep(stall)
        return stall

    async def _wait_for_overlapped(self) -> float:
        """The step ends when the slot copies it overlapped end too; the excess is stall."""
        assert self.swapper is not None
        wait = max(0.0, self._overlap_end - anyio.current_time())
        if wait > 0:
            self.swapper.add_stall(wait)
            await anyio.sleep(wait)
        return wait
