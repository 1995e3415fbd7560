"""The torch step runner: owns the model, its arena and each request's tokens and block table on
the device side, and turns one `ExecuteStep` into one forward pass and one sampling pass."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import attrs
import torch

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.messages import ExecuteStep, RequestSetup, SampledToken, SeqWork, StepFinished
from engine.params import SamplingParams
from gpu.config import ModelConfig
from gpu.device_thread import DeviceThread
from gpu.metadata import StepInputs, build_step_inputs
from gpu.model import CausalLM
from gpu.sampler import make_generator, sample
from gpu.swap import TorchSwapper
from gpu.thread_tuner import ThreadTuner, thread_candidates

SwapperFactory = Callable[[torch.Tensor, int], TorchSwapper]
"""Makes the swap copier from the arena's KV ([blocks, L, 2, bs, H, D]) and a host block count."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N`; ConfigError (naming `--device`) for anything this
    machine cannot run."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: not a device Shunter runs on (cpu, cuda, cuda:N or "
                          f"auto)")
    if device.type == "cuda" and not torch.cuda.is_available():
        why = ("was built without CUDA" if torch.version.cuda is None
               else f"found no device for CUDA {torch.version.cuda}")
        raise ConfigError(f"--device {name}: this machine has no CUDA device "
                          f"(torch {torch.__version__} {why})")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s), numbered from 0")
    return device


def resolve_dtype(name: str, model: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU (bf16 matmuls there are slow and inexact) and the model's own
    dtype on CUDA."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(model.torch_dtype, torch.bfloat16)


@attrs.define(slots=True, eq=False)
class _DeviceSeq:
    tokens: list[int]
    table: list[int]
    sampling: SamplingParams
    generator: torch.Generator | None


class TorchRunner:
    """Runs steps for real. Every torch call (loading, the swap space, each step) runs on the
    runner's own `DeviceThread`, so the event loop stays free and OpenMP keeps one thread pool
    (see gpu/device_thread.py for what a second pool costs)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, num_blocks: int, *,
                 swapper_factory: SwapperFactory = TorchSwapper) -> None:
        self._config = config
        self._model_config = model_config
        self.num_blocks = num_blocks
        """KV blocks the arena holds."""
        self._swapper_factory = swapper_factory
        self._device = resolve_device(config.device)
        self._dtype = resolve_dtype(config.dtype, model_config, self._device)
        self._seqs: dict[int, _DeviceSeq] = {}
        self._model = None
        self._thread = DeviceThread()
        self.swapper: TorchSwapper | None = None
        """The swap pool's copier (`gpu.swap.TorchSwapper`) once `make_swapper` made it."""
        self._step_records: list[tuple[ExecuteStep, float, float]] | None = None
        self.thread_tuner: ThreadTuner | None = None
        """On CPU without an explicit `threads`: picks the thread count from step times."""

    def record_steps(self) -> list[tuple[ExecuteStep, float, float]]:
        """From now on append every step `execute` runs, with its perf_counter start and end,
        to the list returned (the in-engine calibration and the throughput bench read it)."""
        self._step_records = []
        return self._step_records

    async def make_swapper(self, num_host_blocks: int) -> TorchSwapper:
        """A host swap space of `num_host_blocks` blocks next to the arena (pinned on CUDA),
        with the worker threads that copy between them (FastSwitch §3.2)."""
        self.swapper = await self._thread.run(
            self._swapper_factory, self._model.arena.kv, num_host_blocks)
        return self.swapper

    async def start(self) -> range:
        """Load the weights into the arena (on the device thread); returns the KV block ids."""
        return await self._thread.run(self._load)

    def close(self) -> None:
        """End the device thread (the engine calls this after the swapper has stopped)."""
        self._thread.close()

    def _load(self) -> range:
        if self._config.threads:
            torch.set_num_threads(self._config.threads)
        elif self._device.type == "cpu":
            self.thread_tuner = ThreadTuner(thread_candidates(torch.get_num_threads()),
                                            torch.set_num_threads)
        backend = self._config.attention_backend
        if backend == "auto":
            backend = "triton" if self._device.type == "cuda" else "torch"
        self._model = CausalLM.from_pretrained(
            self._config.model, device=self._device, dtype=self._dtype,
            num_kv_blocks=self.num_blocks, block_size=self._config.block_size,
            attention_backend=backend,
        )
        return self._model.arena.kv_block_ids

    async def step(self, step: ExecuteStep) -> StepFinished:
        return await self._thread.run(self.execute, step)

    def execute(self, step: ExecuteStep) -> StepFinished:
        began = time.perf_counter()
        for rid in step.release:
            self._seqs.pop(rid, None)
        for s in step.setups:
            self._setup(s)
        for u in step.blocks:
            seq = self._seqs[u.request_id]
            if u.reset:
                seq.table.clear()
            seq.table.extend(u.append)
        stall = self._wait_for_swaps(step) if self.swapper is not None else 0.0
        sampled: list[SampledToken] = []
        if step.seqs:
            sampled = self._timed_forward_and_sample(step.seqs)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        if self._step_records is not None:
            self._step_records.append((step, began, time.perf_counter()))
        return StepFinished(step_id=step.step_id, sampled=tuple(sampled),
                            compute_s=time.perf_counter() - began - stall, stall_s=stall)

    def _timed_forward_and_sample(self, work: Sequence[SeqWork]) -> list[SampledToken]:
        tuner = self.thread_tuner
        if tuner is None:
            return self._forward_and_sample(work)
        tuner.begin((len(work), sum(w.num_tokens for w in work)))
        began = time.perf_counter()
        sampled = self._forward_and_sample(work)
        tuner.end(time.perf_counter() - began)
        return sampled

    def _wait_for_swaps(self, step: ExecuteStep) -> float:
        """Wait for this step's synchronous swap-ins, then for exactly the swaps still using a
        block the step writes (FastSwitch §3.2's conflicts). Returns the seconds waited."""
        began = time.perf_counter()
        self.swapper.wait(step.wait_tickets)
        conflicts = self.swapper.wait_blocks(self._written_blocks(step.seqs))
        if not (step.wait_tickets or conflicts):
            return 0.0
        stall = time.perf_counter() - began
        self.swapper.add_stall(stall)
        return stall

    def _written_blocks(self, work: Sequence[SeqWork]) -> Iterator[int]:
        bs = self._config.block_size
        for w in work:  # a negative entry -b - 1 is block b filled right to left (BROS §5.1)
            yield from (e if e >= 0 else -e - 1 for e in self._seqs[w.request_id].table[w.written(bs)])

    def _setup(self, s: RequestSetup) -> None:
        gen = make_generator(s.sampling, fallback_seed=s.request_id, device=self._device)
        self._seqs[s.request_id] = _DeviceSeq(tokens=list(s.prompt_ids), table=[],
                                              sampling=s.sampling, generator=gen)

    @torch.inference_mode()
    def _forward_and_sample(self, work: Sequence[SeqWork]) -> list[SampledToken]:
        # prefill chunks first, then single-token decodes: the layout AttentionMetadata expects
        ordered = sorted(work, key=lambda w: w.num_tokens == 1)
        inputs = self._prepare(ordered)
        logits = self._model.forward(inputs.input_ids, inputs.positions, inputs.meta,
                                     inputs.logits_indices)  # [S', V]
        samplers = [self._seqs[w.request_id] for w in ordered if w.sample]
        tokens = sample(logits, [s.sampling for s in samplers], [s.generator for s in samplers])
        out = []
        for w, tok in zip((w for w in ordered if w.sample), tokens):
            self._seqs[w.request_id].tokens.append(tok)
            out.append(SampledToken(request_id=w.request_id, token_id=tok))
        return out

    def _prepare(self, ordered: Sequence[SeqWork]) -> StepInputs:
        chunks = []
        for w in ordered:
            seq = self._seqs[w.request_id]
            chunks.append((seq.tokens[w.start:w.start + w.num_tokens], w.start, seq.table))
        return build_step_inputs(chunks, self._config.block_size, self._device,
                                 sample=[w.sample for w in ordered])
