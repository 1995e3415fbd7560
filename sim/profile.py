"""Named timing profiles: a model's shape, a GPU, an iteration cost model and a copy engine.

A profile is a JSON file in `sim/profiles/` (or any path). Each names its `source`: the
measurements it was fitted from. `shunter profile list` prints the shipped names;
`shunter profile fit` writes a new one from measurements on the machine at hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from engine.cost_model import CostModel
from engine.errors import ConfigError
from sim.arena_layout import weight_blocks

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@attrs.frozen(kw_only=True)
class ModelShape:
    """What memory sizing and copy sizes depend on (a Llama/Qwen2-family decoder)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int = 8192
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2

    @property
    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * self.num_heads * self.head_dim * 2 + h * kv * 2
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * layer + heads * self.vocab_size * h + h

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size


@attrs.frozen(kw_only=True)
class CopyLink:
    """The host <-> device link a swap goes over (FastSwitch §2, Challenge #1)."""

    bandwidth_gb_per_s: float
    """Effective bytes per second (1e9) in each direction."""
    dispatch_us: float
    """CPU-side cost of issuing one copy call (`cudaMemcpyAsync`): paid per call, so many small
    per-block copies are slow however fast the link is."""

    source: str = ""
    """Where the two numbers come from (sim/copy_costs.py for the shipped profiles)."""

    def copy_s(self, calls: int, nbytes: int) -> float:
        return calls * self.dispatch_us * 1e-6 + nbytes / (self.bandwidth_gb_per_s * 1e9)


@attrs.frozen(kw_only=True)
class EngineCost:
    """The serving engine's own time per iteration, outside the step (issue 18): planning, the
    allocator, the hops to and from the device thread, outputs and streaming. A real engine
    spends it between steps; the simulator's actors take no virtual time, so a profile fitted
    on this machine (`shunter/fidelity.py`) carries it and the sim runner sleeps it. Profiles
    without it (the shared GPU profiles) charge nothing."""

    per_iteration_ms: float = 0.0
    per_seq_ms: float = 0.0
    """Per sequence the step computed."""
    per_sampled_ms: float = 0.0
    """Per token the step sampled (outputs, detokenizing, streaming)."""
    before_share: float = 0.5
    """Share of it spent before the step starts (planning, messages); the rest after it ends,
    before its tokens reach the frontend."""
    source: str = ""
    copy_start_ms: float = 0.0
    """From a plan to the moment the swaps it issued reach the copier (the swap pool's hop):
    the sim's copies start this long after the plan, during the share before the step."""
    planning_scale: float | None = None
    """None: the scheduler's planning is in the costs above. A number: they were fitted net of
    it (`shunter.fidelity.fit_engine_cost`), and the simulator charges its own planning's CPU
    time times this number instead (the sim backend turns `EngineConfig.charge_scheduler_time`
    on with it): how much longer the real engine planned the same workloads than the sim
    (`shunter.fidelity.planning_scale`; its steps share the caches with the planner).
    `copy_start_ms` then counts from the end of planning."""
    swap_dispatch_ms: float = 0.0
    """More engine time before a step whose iteration dispatched swaps (the plan's detour
    through the swap pool, which issues them and forwards the step), ..."""
    per_transfer_ms: float = 0.0
    """... and per transfer it issued; the copies start meanwhile, as on the real engine,
    which waits for them only when the step begins (`shunter.fidelity.fit_swap_dispatch`)."""
    copy_pickup_ms: float = 0.0
    """From a transfer's submission to its copy's start when the copier had nothing to do:
    its worker thread's wake-up (on the CPU backend it waits for the interpreter while the
    engine's thread carries on). Copies submitted while others run or wait to start start when
    the copier can (`shunter.copier_timing.copy_pickup_ms`)."""
    wake_ms: float = 0.0
    """From the end of the copies a step waited for to the step's start: the device thread's
    wake-up, added to every stall (`shunter.copier_timing.stall_wake_ms`)."""

    def swap_ms(self, transfers: int) -> float:
        """Engine time before a step for the `transfers` swaps its iteration issued."""
        return self.swap_dispatch_ms + self.per_transfer_ms * transfers if transfers else 0.0

    def ms(self, seqs: int, sampled: int) -> float:
        return self.per_iteration_ms + self.per_seq_ms * seqs + self.per_sampled_ms * sampled


@attrs.frozen(kw_only=True)
class CopyContention:
    """Copies that share the machine with the engine (issue 18). On a GPU the copy engine
    runs beside compute; on a CPU torch backend the swapper's copy threads run on the same
    cores (and interpreter) as the model's steps and the engine's own work, so each second of
    copying that overlaps them lengthens them. Fitted from recorded runs
    (`shunter.contention.fit_contention`); profiles without it (every GPU profile) charge none."""

    engine: float = 0.0
    """Engine time added per second of copying that overlaps the engine's own work."""
    step: float = 0.0
    """Step time added per second of copying that overlaps a step's compute."""
    swapped_in_ms: float = 0.0
    """Step time added per swap ticket the step waited for (its synchronous swap-ins): it reads
    KV the copier's thread has just written from another core
    (`shunter.copier_timing.fit_swapped_in`)."""
    source: str = ""


@attrs.frozen(kw_only=True)
class Profile:
    name: str
    model: ModelShape
    gpu: str
    gpu_memory_gib: float
    cost: CostModel
    link: CopyLink
    memory_utilization: float = 0.9
    """Share of device memory the engine may use for weights + KV (vLLM's default)."""
    activation_gib: float = 0.0
    """Device memory the steps' activations take out of that share (vLLM's profiling step)."""
    source: str = ""
    engine_cost: EngineCost | None = None
    """The engine's own cost around each step; None (charged nothing) unless fitted here."""
    copy_contention: CopyContention | None = None
    """What copies cost the engine beside them; None (they overlap for free) unless fitted on
    a backend whose copies share its cores."""

    def num_blocks(self, block_size: int, memory_utilization: float | None = None) -> int:
        """KV blocks that fit in the device memory left after the weights, as the torch
        backend's arena holds them (gpu/arena.py): the usable memory in whole blocks, less the
        blocks the weights take there, each decoder layer from its own block boundary
        (sim/arena_layout.py `weight_blocks`; Llama-3-8B: 7,691 blocks of 16 tokens, where the
        unaligned weights fill 7,658.x: 33 KV blocks fewer than counting those)."""
        usable = self.gpu_memory_gib * 2**30 * (memory_utilization or self.memory_utilization)
        room = int((usable - self.activation_gib * 2**30) // self.model.block_bytes(block_size))
        n = room - weight_blocks(self.model, block_size)
        if n <= 0:
            raise ConfigError(
                f"profile {self.name}: the weights ({self.model.weight_bytes / 2**30:.1f} GiB) "
                f"leave no room for KV blocks in {usable / 2**30:.1f} GiB")
        return n

    def to_json(self) -> dict[str, Any]:
        cost = attrs.asdict(self.cost)
        for runtime_only in ("source", "copy", "block_bytes"):  # the link is `copy_link`
            cost.pop(runtime_only)
        return {"name": self.name, "source": self.source, "gpu": self.gpu,
                "gpu_memory_gib": self.gpu_memory_gib,
                "memory_utilization": self.memory_utilization,
                **({"activation_gib": self.activation_gib} if self.activation_gib else {}),
                "model": attrs.asdict(self.model), "cost_model": cost,
                "copy_link": attrs.asdict(self.link),
                **({"engine_cost": attrs.asdict(self.engine_cost)} if self.engine_cost else {}),
                **({"copy_contention": attrs.asdict(self.copy_contention)}
                   if self.copy_contention else {})}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> Profile:
        try:
            source = data.get("source", "")
            return cls(
                name=data["name"], source=source, gpu=data["gpu"],
                gpu_memory_gib=float(data["gpu_memory_gib"]),
                memory_utilization=float(data.get("memory_utilization", 0.9)),
                activation_gib=float(data.get("activation_gib", 0.0)),
                model=ModelShape(**data["model"]),
                cost=CostModel(**data["cost_model"], source=f"profile {data['name']}: {source}"),
                link=CopyLink(**data["copy_link"]),
                engine_cost=EngineCost(**data["engine_cost"]) if "engine_cost" in data else None,
                copy_contention=(CopyContention(**data["copy_contention"])
                                 if "copy_contention" in data else None))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: not a valid profile: {type(exc).__name__}: {exc}") from None


def list_profiles() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (`llama3-8b-a100`) or a profile JSON file by path."""
    text = str(name_or_path)
    path = Path(text) if text.endswith(".json") or "/" in text else PROFILE_DIR / f"{text}.json"
    if not path.is_file():
        known = ", ".join(list_profiles())
        raise ConfigError(f"no profile {text!r} (no file {path}); shipped profiles: {known}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON: {exc.msg} at line {exc.lineno}") from None
    return Profile.from_json(data, str(path))


def save_profile(profile: Profile, path: Path) -> None:
    path.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
