"""Pipeline-parallel execution on the torch backend: a 2-stage pipeline (two processes, gloo)
serves 32 concurrent prompts with the same greedy tokens as one in-process engine and as
transformers."""

from __future__ import annotations

import sys

import anyio
import attrs
import pytest

import shunter
from gpu.config import ModelConfig
from gpu.pipeline import PipelineRunner
from shunter.backends import build_backend
from tests.cluster.prompts import MAX_TOKENS, PROMPTS
from tests.proc_status import ignores_sigint
from tests.reference import assert_matches, greedy_reference


async def _serve_all(engine: shunter.Engine) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()] * len(PROMPTS)

    async def one(i: int) -> None:
        done = await engine.complete(PROMPTS[i], shunter.SamplingParams(max_tokens=MAX_TOKENS,
                                                                        temperature=0))
        out[i] = tuple(done.token_ids)

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return out


def _config(model_dir, **kw) -> shunter.EngineConfig:
    return shunter.EngineConfig(model=model_dir, device="cpu", threads=1, num_blocks=64,
                                cpu_swap_blocks=0, max_num_seqs=32, **kw)


@pytest.mark.anyio
async def test_two_stage_pipeline_equals_one_instance_and_transformers(tiny_llama_dir,
                                                                       pipeline_group):
    config = _config(tiny_llama_dir, pipeline_stages=2)
    runner = PipelineRunner(config, ModelConfig.from_dir(tiny_llama_dir), 64, group=pipeline_group)
    runner.records = []
    backend = attrs.evolve(build_backend(config), runner=runner)
    async with shunter.Engine.start(config, backend=backend) as engine:
        piped = await _serve_all(engine)
        await engine.wait_idle()
    async with shunter.Engine.start(_config(tiny_llama_dir)) as engine:
        single = await _serve_all(engine)
    assert piped == single
    for i, tokens in enumerate(piped):
        ref = greedy_reference(tiny_llama_dir, PROMPTS[i], MAX_TOKENS)
        assert_matches(tokens, ref, f"prompt {i}")
    # microbatches kept both stages working within a step: a step of the whole batch ran as
    # several microbatches on each stage, and stage 1 waited for stage 0's activations
    big = [r for r in runner.records if len(r.compute_s[0]) == 4]
    assert big, [len(r.compute_s[0]) for r in runner.records]
    assert all(len(r.compute_s[1]) == 4 for r in big)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_stage_processes_leave_ctrl_c_to_the_driver(pipeline_group):
    """Ctrl-C in a terminal signals the whole process group: the stages ignore SIGINT (they end
    when the driver stops them), so an engine serving through a pipeline drains on Ctrl-C as
    one without does (before: each stage raised KeyboardInterrupt out of its message loop at
    once and exited with a traceback, and the driver lost it)."""
    assert pipeline_group.pids
    for pid in pipeline_group.pids:
        assert ignores_sigint(pid), pid
