"""Measure the torch runner's step time over a grid of batch shapes, for `shunter profile fit`.

Each measured step is a real `TorchRunner.execute` (input preparation, forward, sampling), the
same call the executor makes, on sequences whose cached prefix was prefilled beforehand (not
timed). The median of a few repeats is kept. Turning these into a simulator profile is
`shunter/calibrate.py`'s work.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from engine.config import EngineConfig
from engine.cost_model import BatchShape
from engine.messages import BlockUpdate, ExecuteStep, RequestSetup, SeqWork
from engine.params import SamplingParams
from gpu.config import ModelConfig
from gpu.device_thread import call_on_own_thread
from gpu.runner import TorchRunner, resolve_device

Batch = Sequence[tuple[int, int]]
"""(cached tokens, new tokens) per sequence; one new token is a decode."""


def default_grid(max_context: int, max_tokens: int = 512,
                 max_batch_context: int = 16384) -> list[Batch]:
    """BROS §4.1: lengths at exponential intervals of 2. Prefills alone (8 tokens up to one
    iteration's budget), prefills after a cached prefix, decode batches (1 to 64 sequences) over
    context lengths 16 up to the model's context, within at most `max_batch_context` cached
    tokens per decode batch (on a CPU, attention over more falls out of cache and grows faster
    than linearly, which the linear cost model cannot follow); and a few mixed batches, which
    the split fit holds out to check the per-batch sum."""
    powers = [2 ** k for k in range(3, 17)]
    grid: list[Batch] = []
    for p in powers:
        if p <= min(max_tokens, max_context):
            grid.append([(0, p)])
    for p, prefix in itertools.product((64, 256), (256, 1024)):
        if p + prefix <= max_context and p <= max_tokens:
            grid.append([(prefix, p)])
    for b, ctx in itertools.product((1, 2, 4, 8, 16, 32, 64), powers[1:]):
        if ctx < max_context and b * ctx <= max_batch_context:
            grid.append([(ctx, 1)] * b)
    for p, b in ((64, 8), (128, 16), (256, 32)):
        if p <= max_tokens and 256 < max_context:
            grid.append([(0, p)] + [(256, 1)] * b)
    return grid


class StepTimer:
    """Owns a TorchRunner and hands out block ids for the sequences it times."""

    def __init__(self, config: EngineConfig, model: ModelConfig, num_blocks: int) -> None:
        self.config = config
        self.model = model
        self.runner = TorchRunner(config, model, num_blocks)
        self.runner._load()
        self._ids = itertools.count(1)
        self._steps = itertools.count(1)

    def time_batch(self, batch: Batch, repeats: int = 3) -> float:
        """Median ms of one step computing `batch`."""
        bs = self.config.block_size
        rids = [next(self._ids) for _ in batch]
        next_block = 0
        setups, blocks = [], []
        for rid, (start, n) in zip(rids, batch):
            total = start + n
            prompt = [(rid * 7919 + i * 104729) % (self.model.vocab_size - 3) + 3 for i in range(total)]
            need = -(-total // bs)
            setups.append(RequestSetup(request_id=rid, prompt_ids=prompt,
                                       sampling=SamplingParams(max_tokens=1), eos_token_ids=()))
            blocks.append(BlockUpdate(request_id=rid, reset=False,
                                      append=tuple(range(next_block, next_block + need))))
            next_block += need
        if next_block > self.runner.num_blocks:
            raise ValueError(f"batch needs {next_block} KV blocks, the arena has {self.runner.num_blocks}")
        prefix = [SeqWork(request_id=r, start=0, num_tokens=s, sample=False)
                  for r, (s, _) in zip(rids, batch) if s]
        self._run(setups=tuple(setups), blocks=tuple(blocks), seqs=tuple(prefix))
        work = tuple(SeqWork(request_id=r, start=s, num_tokens=n, sample=True)
                     for r, (s, n) in zip(rids, batch))
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            self._run(seqs=work)
            times.append((time.perf_counter() - began) * 1000.0)
        self._run(release=tuple(rids))
        return statistics.median(times)

    def _run(self, *, setups=(), blocks=(), seqs=(), release=()) -> None:
        self.runner.execute(ExecuteStep(step_id=next(self._steps), release=release,
                                        setups=setups, blocks=blocks, seqs=seqs))


def measure(config: EngineConfig, grid: Sequence[Batch] | None = None, *, repeats: int = 3,
            on_row: Callable[[int, int], None] | None = None) -> list[tuple[BatchShape, float]]:
    """(shape, median ms) for every batch of the grid, on the model `config` names. Runs on a
    thread of its own, as the engine's steps do (gpu/device_thread.py)."""
    return call_on_own_thread(_measure, config, grid, repeats, on_row)


def _measure(config: EngineConfig, grid: Sequence[Batch] | None, repeats: int,
             on_row: Callable[[int, int], None] | None) -> list[tuple[BatchShape, float]]:
    model = ModelConfig.from_dir(config.model)
    grid = list(grid or default_grid(model.max_position_embeddings, config.max_batched_tokens))
    bs = config.block_size
    most = max(sum(-(-(s + n) // bs) for s, n in b) for b in grid)
    timer = StepTimer(config, model, num_blocks=most + 1)
    timer.time_batch(grid[0], repeats=2)  # warm-up: first calls allocate and pick kernels
    rows = []
    for i, batch in enumerate(grid):
        rows.append((BatchShape.of(batch), timer.time_batch(batch, repeats)))
        if on_row:
            on_row(i + 1, len(grid))
    return rows


def measure_copy(device: str = "cpu", big_mib: int = 64, small_kib: int = 16,
                 calls: int = 200) -> tuple[float, float]:
    """(GB/s of one large device -> host copy, us per small copy call) on this machine."""
    return call_on_own_thread(_measure_copy, device, big_mib, small_kib, calls)


def _measure_copy(device: str, big_mib: int, small_kib: int, calls: int) -> tuple[float, float]:
    dev = resolve_device(device)
    pin = dev.type == "cuda"
    src = torch.empty(big_mib * 2**20, dtype=torch.uint8, device=dev)
    dst = torch.empty(src.shape, dtype=torch.uint8, pin_memory=pin)
    dst.copy_(src)  # warm-up

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    began = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=pin)
    sync()
    gb_per_s = 3 * src.numel() / (time.perf_counter() - began) / 1e9
    n = small_kib * 1024
    began = time.perf_counter()
    for i in range(calls):
        dst[i * n:(i + 1) * n].copy_(src[i * n:(i + 1) * n], non_blocking=pin)
    sync()
    per_call_s = (time.perf_counter() - began) / calls - n / (gb_per_s * 1e9)
    return gb_per_s, max(per_call_s, 0.0) * 1e6
