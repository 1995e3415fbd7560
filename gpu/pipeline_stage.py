"""One pipeline stage: a process holding a contiguous range of decoder layers, its own arena
(the KV of just those layers) and a torch.distributed link to its neighbours.

Every stage gets the same control message per step (`StageStep`: the executor's `ExecuteStep`
plus the tokens the last stage sampled in the step before) and does the same bookkeeping, so
each knows every sequence's tokens, positions and block table; then it cuts the step into the
same microbatches (`engine.cluster.plan.split_microbatches`) and for each one receives the
previous stage's hidden states (or embeds the tokens), runs its layers, and queues the result
for the next stage (`TransferQueue`) while it starts on the next microbatch. The last stage
samples. Tensors travel only over torch.distributed; the pipes carry attrs messages of ints.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from engine.cluster.plan import split_microbatches
from engine.messages import ExecuteStep, SampledToken, SeqWork
from engine.params import SamplingParams
from gpu.metadata import build_step_inputs
from gpu.model import CausalLM
from gpu.sampler import make_generator, sample
from gpu.transfer import TransferQueue


@attrs.frozen(kw_only=True)
class StageSpec:
    """What one stage process is started with."""

    model: Path
    stage: int
    layers: tuple[int, int]
    """[first, stop) of the model's decoder layers."""
    num_stages: int
    num_blocks: int
    block_size: int
    device: str
    dtype: str
    attention_backend: str
    threads: int | None
    init_method: str
    """torch.distributed rendezvous, e.g. tcp://127.0.0.1:PORT."""
    microbatches: int


@attrs.frozen(kw_only=True)
class StageStep:
    step: ExecuteStep
    fed_back: tuple[SampledToken, ...]
    """Tokens the last stage sampled in the previous step (the other stages append them)."""


@attrs.frozen(kw_only=True)
class StageReset:
    """Forget every sequence (the engine using this group stopped)."""


@attrs.frozen(kw_only=True)
class StageStop:
    pass


@attrs.frozen(kw_only=True)
class StageReady:
    stage: int
    pid: int


@attrs.frozen(kw_only=True)
class StageDone:
    step_id: int
    sampled: tuple[SampledToken, ...]
    """Filled by the last stage only."""
    compute_s: tuple[float, ...]
    """Per microbatch: seconds in this stage's layers (and sampling, on the last)."""
    wait_s: tuple[float, ...]
    """Per microbatch: seconds waiting for the previous stage's activations."""
    wall_s: float


@attrs.frozen(kw_only=True)
class StageFailed:
    stage: int
    error: str


@attrs.define(slots=True, eq=False)
class _Seq:
    tokens: list[int]
    table: list[int]
    sampling: SamplingParams
    generator: torch.Generator | None


class StageWorker:
    """The stage's model part and its sequences' bookkeeping; runs one `StageStep`."""

    def __init__(self, spec: StageSpec, model: CausalLM, queue: TransferQueue | None) -> None:
        self.spec = spec
        self.model = model
        self.device = model.arena.device
        self._queue = queue
        self._offset = model.arena.weight_blocks
        """Logical block b (what the allocator hands out) is arena block b + offset here: each
        stage's arena has its own weights in front of the KV blocks."""
        self._seqs: dict[int, _Seq] = {}
        self._hidden = model.config.hidden_size
        self._dtype = model.arena.dtype

    def reset(self) -> None:
        self._seqs.clear()

    def run(self, msg: StageStep) -> StageDone:
        began = time.perf_counter()
        step = msg.step
        for t in msg.fed_back:
            seq = self._seqs.get(t.request_id)
            if seq is not None and not self.model.last_stage:
                seq.tokens.append(t.token_id)
        self._book(step)
        ordered = sorted(step.seqs, key=lambda w: w.num_tokens == 1)
        micro = split_microbatches(ordered, self.spec.microbatches,
                                   [w.num_tokens for w in ordered])
        sampled: list[SampledToken] = []
        compute, waits = [], []
        for m, work in enumerate(micro):
            c, w, out = self._microbatch(step.step_id, m, work)
            compute.append(c)
            waits.append(w)
            sampled.extend(out)
        if self._queue is not None:
            self._queue.flush()
        return StageDone(step_id=step.step_id, sampled=tuple(sampled), compute_s=tuple(compute),
                         wait_s=tuple(waits), wall_s=time.perf_counter() - began)

    def _book(self, step: ExecuteStep) -> None:
        for rid in step.release:
            self._seqs.pop(rid, None)
        for s in step.setups:
            gen = make_generator(s.sampling, fallback_seed=s.request_id, device=self.device)
            self._seqs[s.request_id] = _Seq(tokens=list(s.prompt_ids), table=[],
                                            sampling=s.sampling, generator=gen)
        for u in step.blocks:
            seq = self._seqs[u.request_id]
            if u.reset:
                seq.table.clear()
            seq.table.extend(b + self._offset for b in u.append)

    @torch.inference_mode()
    def _microbatch(self, step_id: int, m: int,
                    work: Sequence[SeqWork]) -> tuple[float, float, list[SampledToken]]:
        chunks = []
        for w in work:
            seq = self._seqs[w.request_id]
            chunks.append((seq.tokens[w.start:w.start + w.num_tokens], w.start, seq.table))
        inputs = build_step_inputs(chunks, self.spec.block_size, self.device,
                                   sample=[w.sample for w in work])
        waited = 0.0
        x = inputs.input_ids
        if not self.model.first_stage:
            began = time.perf_counter()
            x = torch.empty(len(inputs.input_ids), self._hidden, dtype=self._dtype,
                            device=self.device)  # [T, hidden]
            dist.recv(x, src=self.spec.stage - 1, tag=_tag(step_id, m))
            waited = time.perf_counter() - began
        began = time.perf_counter()
        out = self.model.forward_stage(x, inputs.positions, inputs.meta, inputs.logits_indices)
        sampled: list[SampledToken] = []
        if self.model.last_stage:
            sampled = sample_work(out, work, self._seqs)
        else:
            self._queue.put_activation(out, dst=self.spec.stage + 1, tag=_tag(step_id, m))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - began, waited, sampled


def sample_work(logits: torch.Tensor, work: Sequence[SeqWork], seqs: Mapping[int, Any]
                ) -> list[SampledToken]:
    """The last stage's sampling: a token for each sequence of `work` that asks for one (rows
    of `logits` in that order), appended to its `tokens` (`seqs`: id -> sequence with
    `tokens`, `sampling` and `generator`)."""
    takers = [w for w in work if w.sample]
    chosen = [seqs[w.request_id] for w in takers]
    tokens = sample(logits, [s.sampling for s in chosen], [s.generator for s in chosen])
    for seq, tok in zip(chosen, tokens):
        seq.tokens.append(tok)
    return [SampledToken(request_id=w.request_id, token_id=tok) for w, tok in zip(takers, tokens)]


def _tag(step_id: int, microbatch: int) -> int:
    return (step_id % 1_000_000) * 256 + microbatch % 256


def stage_main(spec: StageSpec, conn) -> None:  # conn: multiprocessing Connection
    """The stage process: join the group, load the layers, then answer the driver's messages.
    Ctrl-C in a terminal signals the whole process group: stopping is the driver's to decide
    (it drains, then sends `StageStop` or closes the pipe), so SIGINT is ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        device = torch.device(spec.device if spec.device != "cuda" else f"cuda:{spec.stage}")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=spec.init_method, rank=spec.stage,
                                world_size=spec.num_stages)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}.get(spec.dtype)
        model = CausalLM.from_pretrained(
            spec.model, device=device, dtype=dtype, num_kv_blocks=spec.num_blocks,
            block_size=spec.block_size, attention_backend=spec.attention_backend,
            layers=range(*spec.layers))
        last = spec.stage == spec.num_stages - 1
        queue = None if last else TransferQueue()
        worker = StageWorker(spec, model, queue)
    except Exception:
        conn.send(StageFailed(stage=spec.stage, error=traceback.format_exc(limit=4)))
        return
    conn.send(StageReady(stage=spec.stage, pid=os.getpid()))
    try:
        while True:
            msg = conn.recv()
            match msg:
                case StageStep():
                    try:
                        conn.send(worker.run(msg))
                    except Exception as exc:
                        conn.send(StageFailed(stage=spec.stage,
                                              error=f"{type(exc).__name__}: {exc}"))
                case StageReset():
                    worker.reset()
                    conn.send(StageReady(stage=spec.stage, pid=os.getpid()))
                case StageStop():
                    break
    except (EOFError, OSError):
        pass  # the driver went away
    finally:
        if queue is not None:
            queue.close()
        dist.destroy_process_group()
