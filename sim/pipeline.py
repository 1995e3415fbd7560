"""A simulated pipeline instance: the step runner of an instance whose model is cut into K
stages (as gpu/pipeline.py runs it for real), simulated stage by stage on the virtual clock.

Each step is cut into microbatches exactly as the real stages cut it
(`engine.cluster.plan.split_microbatches`). Stage s spends the profile's predicted time of
microbatch m times its share of the layers; the activations of m ([tokens, hidden] at the
model's dtype) cross the link to the next stage (`sim/network.py`); the step ends when the last
stage finishes the last microbatch (`engine.cluster.plan.pipeline_timing`), so the bubbles show
in the step time. Assumed: a stage's cost is the whole model's cost times its layer share (the
embedding, final norm and LM head are spread with the layers, not charged to the ends).
"""

from __future__ import annotations

import anyio

from engine.cluster.plan import (
    PipelineTotals,
    pipeline_timing,
    split_microbatches,
    stage_layers,
)
from engine.cost_model import BatchShape, CostModel
from engine.messages import ExecuteStep, SampledToken, StepFinished
from sim.network import NetworkLink
from sim.profile import ModelShape, Profile
from sim.runner import SIM_TOKEN_ID


class SimPipelineRunner:
    def __init__(self, cost: CostModel, num_blocks: int, *, model: ModelShape, stages: int,
                 microbatches: int, link: NetworkLink) -> None:
        self.cost = cost
        self.num_blocks = num_blocks
        self.stages = stages
        self.microbatches = microbatches
        self.link = link
        layers = stage_layers(model.num_layers, stages)
        self.shares = [len(r) / model.num_layers for r in layers]
        self._token_bytes = model.hidden_size * model.dtype_bytes
        self.totals = PipelineTotals()
        self.busy_s = 0.0

    async def start(self) -> range:
        return range(self.num_blocks)

    async def step(self, step: ExecuteStep) -> StepFinished:
        ordered = sorted(step.seqs, key=lambda w: w.num_tokens == 1)
        micro = split_microbatches(ordered, self.microbatches, [w.num_tokens for w in ordered])
        costs = [self.cost.predict_ms(BatchShape.of((w.start, w.num_tokens) for w in mb)) / 1e3
                 for mb in micro]
        transfer = [self.link.send_s(sum(w.num_tokens for w in mb) * self._token_bytes)
                    for mb in micro]
        timing = pipeline_timing([[c * share for c in costs] for share in self.shares], transfer)
        if timing.makespan > 0:
            await anyio.sleep(timing.makespan)
            self.totals.add(timing, len(micro))
            self.busy_s += timing.makespan
        sampled = tuple(SampledToken(request_id=w.request_id, token_id=SIM_TOKEN_ID)
                        for w in step.seqs if w.sample)
        return StepFinished(step_id=step.step_id, sampled=sampled, compute_s=timing.makespan)


def pipeline_blocks(profile: Profile, block_size: int, stages: int) -> int:
    """KV blocks of a K-stage pipeline of the profile's GPU: each GPU holds 1/K of the weights
    and 1/K of every block (its layers' KV), so K GPUs hold (K x usable - weights) / block."""
    one = profile.num_blocks(block_size)  # (usable - weights - activations) / block
    return one + (stages - 1) * int(
        profile.gpu_memory_gib * 2**30 * profile.memory_utilization
        // profile.model.block_bytes(block_size))
