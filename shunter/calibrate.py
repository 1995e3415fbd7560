"""Turn measurements of the torch backend into a simulator profile for this machine.

`gpu/profiler.py` times steps and copies; `sim/fit.py` fits the cost model to them. What is
here needs both, and one thing more: the in-engine calibration starts a real Engine, which only
the front door may do.
"""

from __future__ import annotations

import platform
import statistics

import anyio
import attrs
import torch

from engine.config import EngineConfig
from engine.cost_model import BatchShape, CostModel
from engine.policy import FcfsPolicy
from gpu.config import ModelConfig
from gpu.runner import resolve_device, resolve_dtype
from shunter.backends import build_backend
from shunter.benchmark.driver import Driver
from shunter.engine import Engine
from shunter.workloads import BatchSource, Workload
from sim.fit import COLUMNS, Fit
from sim.arena_layout import weight_blocks
from sim.profile import CopyLink, ModelShape, Profile


def profile_for(config: EngineConfig, *, name: str, fit: Fit, kv_cache_mib: float,
                gb_per_s: float, dispatch_us: float) -> Profile:
    """A sim profile of `config.model` on this machine: the fitted cost model, the model's shape,
    and a "device" holding the weights plus `kv_cache_mib` of KV (the torch backend's pool)."""
    model = ModelConfig.from_dir(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, model, device)
    shape = ModelShape(
        name=config.model.name, num_layers=model.num_layers, hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size, num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, vocab_size=model.vocab_size,
        max_context=model.max_position_embeddings, tie_word_embeddings=model.tie_word_embeddings,
        dtype_bytes=dtype.itemsize)
    where = platform.processor() or platform.machine()
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    # the weights as the torch arena holds them (whole blocks, each layer from its own
    # boundary): the profile's pool (`Profile.num_blocks`) is then the torch backend's
    weights = weight_blocks(shape, config.block_size) * shape.block_bytes(config.block_size)
    memory = (weights + kv_cache_mib * 2**20) / 2**30
    source = (f"fitted by `shunter profile fit` from {fit.rows} measured TorchRunner steps of "
              f"{config.model} on {device.type} ({where}, {dtype}); mean relative error "
              f"{fit.mean_relative_error:.1%}, max {fit.max_relative_error:.1%}; copy link "
              f"measured with torch copies{fit.note}")
    return Profile(name=name, model=shape, gpu=f"{device.type}: {where}", gpu_memory_gib=memory,
                   memory_utilization=1.0, cost=fit.cost,
                   link=CopyLink(bandwidth_gb_per_s=gb_per_s, dispatch_us=dispatch_us),
                   source=source)


def calibrate_in_engine(config: EngineConfig, cost: CostModel, *, batches: int = 3,
                        batch_size: int = 16) -> tuple[float, float, float]:
    """(k, overhead ms, overhead ms per sequence): how a step measured alone compares with the
    same step inside a running engine. Serves a few closed-loop batches on the real engine,
    recording every step's `execute` time and the gap until the next step starts (scheduling,
    messages, the hop to the device thread). k is the median of in-engine time over the fitted
    prediction; the overhead the median gap between back-to-back steps. The sim has no such
    costs (its actors take no virtual time), so a profile for this machine's engine folds them
    in."""
    backend = build_backend(config)
    timed = backend.runner.record_steps()
    workload = Workload(name="calibration", description="", params={}, requests=(),
                        batches=(BatchSource(batch_size=batch_size, prompt_range=(16, 256),
                                             output_range=(16, 64), max_batches=batches),))

    async def serve() -> None:
        async with Engine.start(config, policy=FcfsPolicy(), backend=backend) as engine:
            await Driver(engine, workload, vocab=backend.vocab_size, declared_classes=set()).run()

    anyio.run(serve)
    steps = [(BatchShape.of([(w.start, w.num_tokens) for w in step.seqs]),
              (end - began) * 1000.0, began, end) for step, began, end in timed]
    work = [s for s in steps if s[0].prefill_tokens or s[0].decode_seqs]
    k = statistics.median(ms / cost.predict_ms(shape) for shape, ms, _, _ in work)
    # the gap after a step grows with the sequences it served (outputs, bookkeeping)
    pairs = [(cur[0].decode_seqs + (cur[0].prefill_tokens > 0), (nxt[2] - cur[3]) * 1000.0)
             for cur, nxt in zip(steps, steps[1:])]
    gaps = sorted(g for _, g in pairs)
    cut = gaps[int(0.9 * (len(gaps) - 1))]  # leave out the idle waits between batches
    kept = [(n, g) for n, g in pairs if g <= cut]
    slope, intercept = statistics.linear_regression([n for n, _ in kept], [g for _, g in kept])
    return k, max(0.0, intercept), max(0.0, slope)


def calibrated(fit: Fit, k: float, overhead_ms: float, per_seq_ms: float = 0.0) -> Fit:
    """The fit with every coefficient scaled by k, the overhead added to the fixed cost and the
    per-sequence overhead to the cost per decode sequence."""
    c = fit.cost
    scaled = {name: getattr(c, name) * k for name in COLUMNS}
    scaled["a_ms"] += overhead_ms
    scaled["d_ms_per_decode_seq"] += per_seq_ms
    note = (f"; calibrated in a running engine: steps x{k:.3f}, +{overhead_ms:.3f} ms per "
            f"iteration, +{per_seq_ms:.4f} ms per sequence")
    return attrs.evolve(fit, cost=attrs.evolve(c, **scaled),
                        calibration=(k, overhead_ms, per_seq_ms), note=note)
