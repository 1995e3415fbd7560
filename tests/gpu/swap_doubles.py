"""Test doubles of `gpu.swap.TorchSwapper`: the real copier with a slow link, a planted bug, a
gate or injected failures, so that tests can make copies race the steps, go wrong, or fail.

They reach an engine through the runner's `swapper_factory` (`torch_backend` below)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import attrs
import torch

from engine.messages import SwapDirection
from engine.policy import SwapGranularity
from gpu.config import ModelConfig
from gpu.runner import SwapperFactory, TorchRunner
from gpu.swap import TorchSwapper
from shunter import EngineConfig
from shunter.backends import Backend, build_backend

Pairs = list[tuple[int, int]]


class SlowSwapper(TorchSwapper):
    """Every ticket waits `copy_delay_s` before copying: a slow link, so that copies outlast
    the steps that race them."""

    def __init__(self, device_kv: torch.Tensor, num_host_blocks: int, *, copy_delay_s: float,
                 **options: int) -> None:
        super().__init__(device_kv, num_host_blocks, **options)
        self.copy_delay_s = copy_delay_s

    def _copy(self, direction: SwapDirection, pairs: Pairs, granularity: SwapGranularity) -> None:
        time.sleep(self.copy_delay_s)
        super()._copy(direction, pairs, granularity)


class ConflictBlindSwapper(SlowSwapper):
    """The bug FastSwitch's conflict handling exists to prevent: a step writes blocks that a
    swap still copies, without waiting for it."""

    def wait_blocks(self, device_blocks: Iterable[int]) -> int:
        return 0


class FailingSwapper(TorchSwapper):
    """Copy calls (one per ticket, counted from 1) listed in `fail_calls` raise `error`."""

    def __init__(self, device_kv: torch.Tensor, num_host_blocks: int, *,
                 fail_calls: frozenset[int], error: Exception) -> None:
        super().__init__(device_kv, num_host_blocks)
        self.fail_calls = fail_calls
        self.error = error
        self.calls = 0
        self._counting = threading.Lock()

    def _copy(self, direction: SwapDirection, pairs: Pairs, granularity: SwapGranularity) -> None:
        with self._counting:
            self.calls += 1
            call = self.calls
        if call in self.fail_calls:
            raise self.error
        super()._copy(direction, pairs, granularity)


class GatedSwapper(TorchSwapper):
    """Tickets whose pairs `held` picks copy only once `gate` is set (at most 5 s)."""

    def __init__(self, device_kv: torch.Tensor, num_host_blocks: int, *,
                 held: Callable[[Pairs], bool], workers: int = 2) -> None:
        super().__init__(device_kv, num_host_blocks, workers=workers)
        self.held = held
        self.gate = threading.Event()

    def _copy(self, direction: SwapDirection, pairs: Pairs, granularity: SwapGranularity) -> None:
        if self.held(pairs):
            self.gate.wait(5)
        super()._copy(direction, pairs, granularity)


def torch_backend(config: EngineConfig, swapper_factory: SwapperFactory) -> Backend:
    """The torch backend `config` names, whose runner makes its swap space with
    `swapper_factory` (e.g. `functools.partial(SlowSwapper, copy_delay_s=0.003)`)."""
    backend = build_backend(config)
    runner = TorchRunner(config, ModelConfig.from_dir(config.model), backend.runner.num_blocks,
                         swapper_factory=swapper_factory)
    return attrs.evolve(backend, runner=runner)


POISON = 50.0
"""What a poisoned host space holds: keys this large take every query's attention, so KV read back
from a slot no copy wrote derails the tokens after it. Not NaN: the torch decode path zeroes the
non-finite values it gathers (gpu/attention.py), which would read such a slot as zeros."""


class PoisonedHostSwapper(SlowSwapper):
    """A slow link whose host space starts poisoned (`POISON`)."""

    def __init__(self, device_kv: torch.Tensor, num_host_blocks: int, **options) -> None:
        super().__init__(device_kv, num_host_blocks, **options)
        self.host_kv.fill_(POISON)
        self.slot_tickets = {"out": 0, "in": 0, "move": 0}

    def _copy(self, direction: SwapDirection, pairs: Pairs, granularity: SwapGranularity) -> None:
        if granularity == "slots":
            self.slot_tickets[direction] += 1
        super()._copy(direction, pairs, granularity)


class SkipOneCheckpointSwapper(PoisonedHostSwapper):
    """The bug BROS's lazy checkpointing must not have: the first checkpoint (the first slot
    copy to the host, made just before RT overwrites those BE slots) is not copied, so its BE
    request gets back KV that was never saved. `read_back` says whether any of those host slots
    was copied back to the device before being written (a request preempted by recompute in
    the meantime drops its checkpoints, and then the bug does no harm)."""

    def __init__(self, device_kv: torch.Tensor, num_host_blocks: int, **options) -> None:
        super().__init__(device_kv, num_host_blocks, **options)
        self.skipped: set[int] | None = None
        self.lost: frozenset[int] = frozenset()
        """The host slots of the skipped copy."""
        self.read_back = False

    def _copy(self, direction: SwapDirection, pairs: Pairs, granularity: SwapGranularity) -> None:
        if granularity == "slots" and direction == "out":
            if self.skipped is None:  # the host slots keep what they held: garbage, here
                self.skipped = {h for _, h in pairs}
                self.lost = frozenset(self.skipped)
                self._scramble(self.skipped)
                return
            self.skipped -= {h for _, h in pairs}
        if granularity == "slots" and direction == "in" and self.skipped:
            self.read_back |= any(h in self.skipped for h, _ in pairs)
        super()._copy(direction, pairs, granularity)

    def _scramble(self, host_slots: set[int]) -> None:
        """Large values of either sign: whatever sign a query has, some of its heads score such
        a key far above the rest (a uniform `POISON` can be ignored by a query of the other sign)."""
        bs = self.host_kv.shape[3]
        noise = torch.Generator().manual_seed(0)
        for h in sorted(host_slots):
            slot = self.host_kv[h // bs, :, :, h % bs]
            slot.copy_(torch.randn(slot.shape, generator=noise) * POISON)
