"""Backends: what the executor runs on, and what the frontend needs to know about the model.

The torch backend's modules are imported when an engine builds one (`_torch_backend`): they
import torch, which takes seconds, and `import shunter`, `shunter --help` and the sim backend
need none of it."""

from __future__ import annotations

from typing import Any

import attrs

from engine.config import EngineConfig
from engine.cost_model import CopyCost, CostModel
from engine.errors import ConfigError
from gpu.tokenizer import IncrementalDetokenizer, Tokenizer
from sim.profile import load_profile
from sim.runner import SimRunner


@attrs.frozen(kw_only=True)
class Backend:
    runner: Any
    """The executor's step runner (`start()`, `step()`)."""
    codec: Any
    """Tokenizer adapter for the frontend, or None when prompts must be token ids."""
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context: int
    """Longest sequence (prompt + output) the model takes."""
    max_prompt_tokens: int
    cost_model: CostModel | None = None
    """Iteration-latency model the policies may consult (the simulator's profile)."""
    planning_scale: float | None = None
    """Sim: the profile's engine cost leaves out the scheduler's planning, so the engine charges
    the sim's own planning times this (`sim.profile.EngineCost.planning_scale`)."""


class TokenizerCodec:
    """Adapts `gpu.tokenizer.Tokenizer` to the frontend's encode/detokenizer interface."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok)


def build_backend(config: EngineConfig) -> Backend:
    if config.backend == "torch":
        return _torch_backend(config)
    if config.backend == "sim":
        return _sim_backend(config)
    raise ConfigError(f"backend {config.backend!r} is not available in this build")


def _sim_backend(config: EngineConfig) -> Backend:
    """No model: steps take the time the profile predicts; prompts must be token ids."""
    profile = load_profile(config.profile)
    num_blocks = config.num_blocks or profile.num_blocks(config.block_size)
    max_context = profile.model.max_context
    runner: Any = SimRunner(profile.cost, num_blocks, link=profile.link, model=profile.model,
                            block_size=config.block_size, engine_cost=profile.engine_cost,
                            contention=profile.copy_contention)
    if config.pipeline_stages > 1:
        from sim.network import LINKS
        from sim.pipeline import SimPipelineRunner, pipeline_blocks

        if config.pipeline_link not in LINKS:
            raise ConfigError(f"pipeline_link {config.pipeline_link!r}: not a link the simulator "
                              f"knows (known: {', '.join(LINKS)})")
        if config.pipeline_stages > profile.model.num_layers:
            raise ConfigError(f"--pipeline-stages {config.pipeline_stages}: the profile's model "
                              f"has {profile.model.num_layers} layers")
        if config.num_blocks is None:
            num_blocks = pipeline_blocks(profile, config.block_size, config.pipeline_stages)
        runner = SimPipelineRunner(
            profile.cost, num_blocks, model=profile.model, stages=config.pipeline_stages,
            microbatches=config.pipeline_microbatches or 2 * config.pipeline_stages,
            link=LINKS[config.pipeline_link])
    return Backend(
        runner=runner, codec=None,
        vocab_size=profile.model.vocab_size, eos_token_ids=(), max_context=max_context,
        max_prompt_tokens=config.max_prompt_tokens or max_context - 1,
        planning_scale=profile.engine_cost.planning_scale if profile.engine_cost else None,
        cost_model=attrs.evolve(profile.cost,
                                block_bytes=profile.model.block_bytes(config.block_size),
                                copy=CopyCost(bandwidth_gb_per_s=profile.link.bandwidth_gb_per_s,
                                              dispatch_us=profile.link.dispatch_us)),
    )


def _torch_backend(config: EngineConfig) -> Backend:
    # torch loads here, not when shunter is imported (see the module docstring)
    from gpu.arena import blocks_for_bytes
    from gpu.config import ModelConfig
    from gpu.runner import resolve_device, resolve_dtype

    model = ModelConfig.from_dir(config.model)
    tokenizer = Tokenizer.from_dir(config.model)
    num_blocks = config.num_blocks
    if num_blocks is None:
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, model, device)
        num_blocks = blocks_for_bytes(model, config.block_size, dtype,
                                      int(config.kv_cache_mib * 2**20))
    max_context = model.max_position_embeddings
    if config.pipeline_stages > 1:
        from gpu.pipeline import PipelineRunner

        runner: Any = PipelineRunner(config, model, num_blocks)
    else:
        # KunServe: follows ExecuteStep.group/pool_blocks/moves (gpu/kunserve_runner.py); a
        # plain TorchRunner when no step carries them
        from gpu.kunserve_runner import KunServeTorchRunner

        runner = KunServeTorchRunner(config, model, num_blocks)
    cost = _fitted_cost(config, model) if config.cost_profile else None
    if hasattr(runner, "cost_model"):
        runner.cost_model = cost  # KunServe's lookahead fits start from it
    return Backend(
        runner=runner,
        codec=TokenizerCodec(tokenizer),
        vocab_size=model.vocab_size,
        eos_token_ids=tuple(model.eos_token_ids),
        max_context=max_context,
        max_prompt_tokens=config.max_prompt_tokens or max_context - 1,
        cost_model=cost,
    )


def _fitted_cost(config: EngineConfig, model: Any) -> CostModel:
    """The cost model of a profile fitted for this model (`shunter profile fit`), with its copy
    link, so the torch backend's policies predict as the simulator's do (BROS §4.1). A profile
    of another model is refused: its step times would be another model's."""
    profile = load_profile(str(config.cost_profile))
    m = profile.model
    mine = (model.num_layers, model.hidden_size, model.num_kv_heads, model.head_dim)
    if (m.num_layers, m.hidden_size, m.num_kv_heads, m.head_dim) != mine:
        raise ConfigError(
            f"cost_profile {config.cost_profile}: fitted for {m.name} ({m.num_layers} layers, "
            f"hidden {m.hidden_size}, {m.num_kv_heads} KV heads of {m.head_dim}), not for "
            f"{config.model} ({mine[0]} layers, hidden {mine[1]}, {mine[2]} KV heads of {mine[3]})")
    return attrs.evolve(profile.cost, block_bytes=m.block_bytes(config.block_size),
                        copy=CopyCost(bandwidth_gb_per_s=profile.link.bandwidth_gb_per_s,
                                      dispatch_us=profile.link.dispatch_us))
