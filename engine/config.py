"""Engine settings: one small frozen class, validated when built."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs

from engine.cost_model_correction import DEFAULT_WINDOW
from engine.errors import ConfigError

Backend = Literal["torch", "sim"]


def default_model_dir() -> Path:
    """The small Llama model shipped inside the `gpu` package (trained by `tools/train_default.py`)."""
    return Path(__file__).resolve().parent.parent / "gpu" / "default_model"


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything the Engine needs to start. Defaults suit the shipped model on a CPU."""

    model: Path = attrs.field(factory=default_model_dir, converter=Path)
    """Hugging Face-format directory: config.json, *.safetensors, tokenizer.json."""
    backend: Backend = "torch"
    """`torch` runs the model; `sim` only waits the time a cost model predicts."""
    device: str = "auto"
    """`cpu`, `cuda`, `cuda:N`, or `auto` (cuda when available)."""
    dtype: str = "auto"
    """`float32`, `bfloat16`, `float16`, or `auto` (float32 on CPU, the model's dtype on CUDA)."""
    attention_backend: str = "auto"
    """`torch`, `triton`, or `auto` (triton on CUDA, torch on CPU)."""
    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int | None = None
    """KV blocks in the device arena; None sizes the pool from `kv_cache_mib`."""
    kv_cache_mib: float = 256.0
    """KV pool size when `num_blocks` is not given."""
    max_num_seqs: int = 64
    """Most requests in one iteration's batch."""
    max_batched_tokens: int = 512
    """Token budget of one iteration; longer prompts are prefilled in chunks."""
    max_queued_requests: int = 1024
    """Admission limit: requests held by the engine (waiting, running or preempted)."""
    max_prompt_tokens: int | None = None
    """Admission limit on prompt length; None means the model's context length."""
    threads: int | None = None
    """torch intra-op threads for the CPU path, kept fixed; None lets the runner choose among one
    per core, half and one by timing its own steps (gpu/thread_tuner.py)."""
    inbox_size: int = 256
    """Capacity of each actor's inbox."""
    policy: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    """Policy file; None means `policies/fcfs.policy`."""
    cpu_swap_blocks: int | None = None
    """Host KV blocks for swapping out and for CPU copies kept across turns (FastSwitch); None:
    as many as the device pool has; 0: no swap space (policies that swap are refused)."""
    profile: str = "llama3-8b-a100"
    """Sim backend: the timing profile (a name from `shunter profile list`, or a JSON path)."""
    cost_profile: str | None = None
    """Torch backend: a profile JSON fitted on this machine (`shunter profile fit`) whose cost
    model the policies predict iterations with (BROS §4.1: profiled offline); None: the engine
    fits one online from its own iterations."""
    cost_correction: int | None = None
    """Torch backend: the policies predict with that model times a running median of measured /
    predicted time over the latest this-many steps of the same phase (with prefill tokens, or
    decode only), so predictions follow the host's speed as it drifts (a busier machine, heat,
    another clock; engine/cost_model_correction.py); 0: the model alone; None: 8 steps. The
    simulator never corrects (its steps take its model's time): a window there is refused."""
    record_iterations: bool = False
    """Keep a per-iteration log in the scheduler (`Engine.take_iteration_log`; for benchmarks)."""
    charge_scheduler_time: bool = False
    """Sim backend: the scheduler's measured CPU time per iteration passes on the virtual
    clock too, so scheduling overhead shows in latencies (BROS §7.4.2). Real backends pay it
    already."""
    scheduler_time_scale: float = 1.0
    """Sim backend, with `charge_scheduler_time`: the charge is the measured time times this.
    A profile fitted net of a real engine's planning sets both (`EngineCost.planning_scale`)."""
    pipeline_stages: int = 1
    """Torch backend: run the model as a pipeline of this many stage processes, each holding a
    contiguous range of layers (gpu/pipeline.py); 1 runs it in this process."""
    pipeline_microbatches: int | None = None
    """Microbatches each pipelined step is cut into; None: twice the stages."""
    pipeline_link: str = "a100-internode"
    """Sim backend: the link between pipeline stages (a name in sim/network.py's LINKS)."""

    @property
    def correction_window(self) -> int:
        """The online cost-model correction's window this engine runs with (0: none)."""
        if self.backend != "torch":
            return 0
        return DEFAULT_WINDOW if self.cost_correction is None else self.cost_correction

    def __attrs_post_init__(self) -> None:
        if self.cpu_swap_blocks is not None and self.cpu_swap_blocks < 0:
            raise ConfigError(f"cpu_swap_blocks must be >= 0, got {self.cpu_swap_blocks}")
        for name in ("block_size", "num_blocks", "kv_cache_mib", "max_num_seqs",
                     "max_batched_tokens", "max_queued_requests", "max_prompt_tokens",
                     "threads", "inbox_size", "pipeline_stages", "pipeline_microbatches"):
            _positive(name, getattr(self, name))
        _positive("scheduler_time_scale", self.scheduler_time_scale)
        if self.cost_correction is not None and self.cost_correction < 0:
            raise ConfigError(f"cost_correction must be >= 0 (0: off), got {self.cost_correction}")
        if self.cost_correction and self.backend != "torch":
            raise ConfigError(f"cost_correction is for the torch backend (the simulator's steps "
                              f"take its model's time: nothing to correct), got backend "
                              f"{self.backend!r}")
        if self.charge_scheduler_time and self.backend != "sim":
            raise ConfigError("charge_scheduler_time is for the sim backend (a real backend's "
                              f"clock already includes the scheduler), got backend {self.backend!r}")
        if self.cost_profile is not None and self.backend != "torch":
            raise ConfigError("cost_profile is for the torch backend (the sim's cost model is its "
                              f"profile), got backend {self.backend!r}")
        if self.backend not in ("torch", "sim"):
            raise ConfigError(f"backend must be 'torch' or 'sim', got {self.backend!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
