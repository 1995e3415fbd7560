"""Pipeline-parallel execution on the torch backend: a group of stage processes
(`gpu.pipeline_stage`) that together hold the whole model, and the step runner an engine drives
them with.

The runner is the executor's `StepRunner`: it sends each step (an attrs message of ids and
numbers, through a pipe per stage) to every stage, and waits for every stage's answer; the last
stage's carries the sampled tokens, which the next step hands back to the others. Activations
flow between the stages over torch.distributed (gloo on CPU, NCCL on CUDA), set up once per
group. A group outlives the engine that uses it when the caller owns it (tests share one).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import anyio
import attrs

from engine.cluster.plan import stage_layers
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.messages import ExecuteStep, SampledToken, StepFinished
from gpu.config import ModelConfig
from gpu.data_plane import free_port
from gpu.pipeline_stage import (
    StageDone,
    StageFailed,
    StageReady,
    StageReset,
    StageSpec,
    StageStep,
    StageStop,
    stage_main,
)


class PipelineError(RuntimeError):
    """A stage failed or its process died."""


@attrs.define(eq=False)
class StepRecord:
    """One step as the stages saw it (the pipeline bench reads these)."""

    step_id: int
    wall_s: float
    compute_s: tuple[tuple[float, ...], ...]
    """compute_s[stage][microbatch]."""
    wait_s: tuple[tuple[float, ...], ...]


class PipelineGroup:
    """K stage processes of one model, joined in one torch.distributed group."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, num_blocks: int,
                 *, stages: int, microbatches: int | None = None) -> None:
        self.stages = stages
        self.microbatches = microbatches or 2 * stages
        self.num_blocks = num_blocks
        try:
            self.layers = stage_layers(model_config.num_layers, stages)
        except ValueError as exc:
            raise ConfigError(f"--pipeline-stages {stages}: {exc}") from None
        self._config = config
        self._conns: list = []
        self._procs: list[mp.Process] = []

    def start(self) -> None:
        """Spawn the stages and wait until each has loaded its layers (blocking)."""
        ctx = mp.get_context("spawn")
        init = f"tcp://127.0.0.1:{free_port()}"
        c = self._config
        for s, layers in enumerate(self.layers):
            spec = StageSpec(
                model=Path(c.model), stage=s, layers=(layers.start, layers.stop),
                num_stages=self.stages, num_blocks=self.num_blocks, block_size=c.block_size,
                device="cpu" if c.device == "auto" else c.device,
                dtype="float32" if c.dtype == "auto" else c.dtype,
                attention_backend="torch" if c.attention_backend == "auto" else c.attention_backend,
                threads=c.threads, init_method=init, microbatches=self.microbatches)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=stage_main, args=(spec, child), daemon=True,
                               name=f"shunter-stage-{s}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        for s in range(self.stages):
            self._expect(s, StageReady)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def roundtrip(self, msg: StageStep | StageReset) -> list:
        """Send `msg` to every stage and return their answers, in stage order (blocking)."""
        for conn in self._conns:
            conn.send(msg)
        want = StageDone if isinstance(msg, StageStep) else StageReady
        return [self._expect(s, want) for s in range(self.stages)]

    def _expect(self, stage: int, kind: type):
        try:
            answer = self._conns[stage].recv()
        except (EOFError, OSError):
            proc = self._procs[stage]
            proc.join(timeout=1)
            raise PipelineError(f"pipeline stage {stage} (pid {proc.pid}) died "
                                f"(exit code {proc.exitcode})") from None
        if isinstance(answer, StageFailed):
            raise PipelineError(f"pipeline stage {stage} failed: {answer.error}")
        assert isinstance(answer, kind), answer
        return answer

    def stop(self) -> None:
        for conn in self._conns:
            try:
                conn.send(StageStop())
            except (OSError, BrokenPipeError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._conns, self._procs = [], []


class PipelineRunner:
    """The executor's step runner over a `PipelineGroup` (its own, or one the caller owns)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, num_blocks: int, *,
                 group: PipelineGroup | None = None) -> None:
        self._owned = group is None
        self.group = group or PipelineGroup(config, model_config, num_blocks,
                                            stages=config.pipeline_stages,
                                            microbatches=config.pipeline_microbatches)
        self.num_blocks = self.group.num_blocks
        self._fed_back: tuple[SampledToken, ...] = ()
        self.records: list[StepRecord] | None = None
        """Set to a list to keep a `StepRecord` per step."""

    async def start(self) -> range:
        if self._owned:
            await anyio.to_thread.run_sync(self.group.start)
        else:
            await anyio.to_thread.run_sync(self.group.roundtrip, StageReset())
        return range(self.num_blocks)

    async def step(self, step: ExecuteStep) -> StepFinished:
        return await anyio.to_thread.run_sync(self._step, step)

    def _step(self, step: ExecuteStep) -> StepFinished:
        began = time.perf_counter()
        done: list[StageDone] = self.group.roundtrip(StageStep(step=step, fed_back=self._fed_back))
        sampled = done[-1].sampled
        self._fed_back = sampled
        if self.records is not None:
            self.records.append(StepRecord(
                step_id=step.step_id, wall_s=time.perf_counter() - began,
                compute_s=tuple(d.compute_s for d in done), wait_s=tuple(d.wait_s for d in done)))
        return StepFinished(step_id=step.step_id, sampled=sampled,
                            compute_s=time.perf_counter() - began)

    def close(self) -> None:
        if self._owned:
            self.group.stop()
