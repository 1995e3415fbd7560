"""The simulator backend: profiles, the step runner on a virtual clock, the copy engine, fitting."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
import trio
import trio.testing

from engine.cost_model import BatchShape, CostModel
from engine.messages import ExecuteStep, SeqWork
from shunter import ConfigError, Engine, EngineConfig, SamplingParams
from shunter.backends import build_backend
from sim.copy_engine import CopyEngine
from sim.fit import fit_cost_model
from sim.profile import CopyLink, ModelShape, Profile, list_profiles, load_profile, save_profile
from sim.runner import SIM_TOKEN_ID, SimRunner

COST = CostModel(a_ms=10.0, b_ms_per_prefill_token=0.5, c_ms_per_prefill_token_sq=0.001,
                 d_ms_per_decode_seq=1.0, e_ms_per_decode_context_token=0.01)


def run_virtual(fn, *args):
    """Run under trio with a clock that jumps whenever every task is blocked."""
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


def make_profile(path: Path, cost: CostModel = COST) -> Path:
    shape = ModelShape(name="toy", num_layers=2, hidden_size=64, intermediate_size=128,
                       num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=500, max_context=4096)
    save_profile(Profile(name="toy", model=shape, gpu="toy", gpu_memory_gib=1.0, cost=cost,
                         link=CopyLink(bandwidth_gb_per_s=10.0, dispatch_us=5.0), source="test"), path)
    return path


def test_shipped_profiles_load_and_name_their_source():
    names = list_profiles()
    assert {"llama3-8b-a100", "llama2-7b-a100", "llama2-7b-h100", "llama2-7b-a40"} <= set(names)
    for name in names:
        assert load_profile(name).source
    p = load_profile("llama3-8b-a100")
    assert p.model.num_params == pytest.approx(8.03e9, rel=0.01)
    assert p.model.kv_bytes_per_token == 128 * 1024          # 2 x 32 layers x 8 heads x 128 x 2 B
    # 80 GiB x 0.9 in 2 MiB blocks of 16 tokens, less the weights as the torch arena holds them
    # (1,003 blocks of global tensors + 32 layers x 209, each layer from its own boundary)
    assert p.num_blocks(16) == int(80 * 2**30 * 0.9 // (2 * 2**20)) - (1003 + 32 * 209)
    assert p.cost.predict_ms(BatchShape(decode_seqs=32, decode_context=32 * 1024)) == pytest.approx(14.0, rel=0.05)


def test_unknown_and_broken_profiles_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no profile 'nope' .*shipped profiles: llama2-7b-a100"):
        load_profile("nope")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x"}')
    with pytest.raises(ConfigError, match=r"bad.json: not a valid profile: KeyError"):
        load_profile(bad)


def test_sim_backend_sizes_its_pool_from_the_profile(tmp_path):
    b = build_backend(EngineConfig(backend="sim", profile=str(make_profile(tmp_path / "t.json"))))
    assert b.codec is None and b.vocab_size == 500 and b.max_context == 4096
    assert b.runner.num_blocks == load_profile(tmp_path / "t.json").num_blocks(16)
    b = build_backend(EngineConfig(backend="sim", num_blocks=77))
    assert b.runner.num_blocks == 77


def test_a_step_takes_the_predicted_time_on_the_virtual_clock():
    runner = SimRunner(COST, 100)
    step = ExecuteStep(step_id=1, release=(), setups=(), blocks=(), seqs=(
        SeqWork(request_id=1, start=0, num_tokens=100, sample=True),
        SeqWork(request_id=2, start=49, num_tokens=1, sample=True),
        SeqWork(request_id=3, start=0, num_tokens=20, sample=False)))

    async def main():
        began = trio.current_time()
        done = await runner.step(step)
        return trio.current_time() - began, done

    elapsed, done = run_virtual(main)
    want = COST.predict_ms(BatchShape.of([(0, 100), (49, 1), (0, 20)])) / 1000
    assert elapsed == pytest.approx(want) and done.compute_s == pytest.approx(want)
    assert [(s.request_id, s.token_id) for s in done.sampled] == [(1, SIM_TOKEN_ID), (2, SIM_TOKEN_ID)]


def test_the_engine_on_the_sim_backend_replays_exact_step_times(tmp_path):
    config = EngineConfig(backend="sim", profile=str(make_profile(tmp_path / "t.json")),
                          max_batched_tokens=512)

    async def main():
        async with Engine.start(config) as engine:
            return await engine.complete(list(range(5, 105)), SamplingParams(max_tokens=3, ignore_eos=True))

    done = run_virtual(main)
    t = done.timeline
    prefill = COST.predict_ms(BatchShape.of([(0, 100)])) / 1000     # 10 + 50 + 10 ms
    decode1 = COST.predict_ms(BatchShape.of([(100, 1)])) / 1000     # 10 + 1 + 1.01 ms
    decode2 = COST.predict_ms(BatchShape.of([(101, 1)])) / 1000
    assert done.token_ids == (SIM_TOKEN_ID,) * 3
    assert t.ttft_s == pytest.approx(prefill)
    assert t.tbt_s == pytest.approx((decode1, decode2))
    assert t.e2e_s == pytest.approx(prefill + decode1 + decode2)


def test_the_iteration_log_is_kept_only_when_asked():
    async def main(record: bool):
        config = EngineConfig(backend="sim", num_blocks=64, record_iterations=record)
        async with Engine.start(config) as engine:
            async with anyio.create_task_group() as tg:
                for n in (30, 40):
                    tg.start_soon(engine.complete, [5] * n, SamplingParams(max_tokens=4, ignore_eos=True))
            log = await engine.take_iteration_log()
            again = await engine.take_iteration_log()
            iterations = (await engine.inspect()).scheduler.iteration
        return log, again, iterations

    log, again, iterations = run_virtual(main, True)
    # One entry per iteration. How the two prefills share iterations depends on the order trio
    # runs the two clients in, so check what every order must give: each request computes its
    # prompt and 3 more tokens, at most both run at once, and the last iteration releases all.
    assert len(log) == iterations >= 5
    assert sum(log.batch_tokens) == 30 + 40 + 2 * 3
    assert max(log.batch_seqs) == 2 and log.batch_seqs[-1] == 0
    assert log.used_blocks[-1] == 0 and 2 <= max(log.used_blocks) <= 6  # ceil(44/16) + ceil(34/16)
    assert all(s > 0 for s in log.scheduler_s) and len(again) == 0
    assert run_virtual(main, False)[0] is None


# ------------------------------------------------------------------------ copy engine


def test_copies_queue_per_direction_and_overlap_across_directions():
    eng = CopyEngine(CopyLink(bandwidth_gb_per_s=1.0, dispatch_us=10.0))
    a = eng.submit(0.0, "out", calls=100, nbytes=10**6)      # 1 ms dispatch + 1 ms transfer
    b = eng.submit(0.0005, "out", calls=1, nbytes=0)         # waits for a
    c = eng.submit(0.0005, "in", calls=1, nbytes=2 * 10**6)  # the other direction: at once
    assert (a.start, a.end) == pytest.approx((0.0, 0.002))
    assert (b.start, b.end) == pytest.approx((0.002, 0.00201))
    assert (c.start, c.end) == pytest.approx((0.0005, 0.00251))
    assert eng.submit(1.0, "out", calls=1, nbytes=0).start == 1.0   # idle engine starts now
    assert eng.stall(0.002, c.end) == pytest.approx(0.00051) and eng.stall(0.003, c.end) == 0.0
    k = eng.counters
    assert (k.copy_ops, k.bytes_out, k.bytes_in) == (103, 10**6, 2 * 10**6)
    assert k.stall_s == pytest.approx(0.00051)


def test_one_group_copy_beats_many_block_copies():
    # FastSwitch §3.1: the same 64 blocks of 128 KB, one call per block vs one call per group
    link = CopyLink(bandwidth_gb_per_s=25.0, dispatch_us=10.0)
    per_block = link.copy_s(64, 64 * 128 * 1024)
    grouped = link.copy_s(1, 64 * 128 * 1024)
    assert per_block == pytest.approx(640e-6 + 335.5e-6, rel=1e-3)
    assert grouped < per_block / 2.5


def test_a_negative_transfer_is_refused():
    with pytest.raises(ValueError, match="calls >= 0 and nbytes >= 0, got -1, 5"):
        CopyEngine(CopyLink(bandwidth_gb_per_s=1, dispatch_us=1)).submit(0, "in", -1, 5)


# ------------------------------------------------------------------------ fitting


def test_the_fit_recovers_known_coefficients():
    true = CostModel(a_ms=5.0, b_ms_per_prefill_token=0.2, c_ms_per_prefill_token_sq=1e-4,
                     d_ms_per_decode_seq=0.3, e_ms_per_decode_context_token=0.002,
                     f_ms_per_prefill_prefix_token=3e-5)
    batches = [[(0, p)] for p in (16, 64, 256, 512)] + [[(k, 64)] for k in (128, 1024)]
    batches += [[(c, 1)] * b for b in (1, 8, 32) for c in (100, 1000)] + [[(0, 128), (500, 1)]]
    rows = [(BatchShape.of(b), true.predict_ms(BatchShape.of(b))) for b in batches]
    fit = fit_cost_model(rows, source="test")
    assert fit.mean_relative_error < 1e-9
    for name in ("a_ms", "b_ms_per_prefill_token", "c_ms_per_prefill_token_sq",
                 "d_ms_per_decode_seq", "e_ms_per_decode_context_token", "f_ms_per_prefill_prefix_token"):
        assert getattr(fit.cost, name) == pytest.approx(getattr(true, name), rel=1e-6)


def test_the_fit_never_goes_negative():
    # decode time that falls with context would need e < 0: the fit drops e instead
    rows = [(BatchShape(decode_seqs=1, decode_context=c), 10.0 - c / 1000) for c in (100, 2000, 5000)]
    rows += [(BatchShape(prefill_tokens=p, prefill_sq=p * p), 10 + p) for p in (10, 100, 300, 600)]
    fit = fit_cost_model(rows, source="test")
    assert all(v >= 0 for v in json.loads(json.dumps(
        {k: getattr(fit.cost, k) for k in ("a_ms", "b_ms_per_prefill_token", "d_ms_per_decode_seq",
                                             "e_ms_per_decode_context_token")})).values())
    assert fit.cost.e_ms_per_decode_context_token == 0.0


# ------------------------------------------------------------------------ fitting on torch


def test_a_profile_fitted_on_the_torch_backend_drives_the_sim(tiny_llama_dir, tmp_path):
    from gpu.profiler import measure
    from shunter.calibrate import profile_for
    from sim.fit import fit_cost_model

    config = EngineConfig(model=tiny_llama_dir, device="cpu", threads=1)
    grid = [[(0, 16)], [(0, 64)], [(0, 128)], [(64, 32)], [(32, 1)] * 4, [(200, 1)] * 8,
            [(100, 1)] * 2, [(0, 32), (50, 1)]]
    rows = measure(config, grid, repeats=1)
    assert len(rows) == len(grid) and all(ms > 0 for _, ms in rows)
    fit = fit_cost_model(rows, source="")
    profile = profile_for(config, name="tiny", fit=fit, kv_cache_mib=8, gb_per_s=5.0, dispatch_us=2.0)
    path = tmp_path / "tiny.json"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert loaded.model.vocab_size == 320 and loaded.model.dtype_bytes == 4
    assert loaded.num_blocks(16) == int(8 * 2**20 // loaded.model.block_bytes(16))
    assert "shunter profile fit" in loaded.source
