"""Check the Triton attention kernels against the torch path on GPU-sized shapes, then time decode
attention with CUDA events. Needs a CUDA GPU; prints one JSON object.

    python bench/kernels_gpu.py                 # checks + Llama-8B-like decode timing
    python bench/kernels_gpu.py --skip-checks --batch 8 --context 8192

Timed: decode over `--batch` sequences of `--context` tokens, 32 query / 8 KV heads, head_dim 128
(Llama-3-8B), with the default tiles, a sweep of alternatives (to revisit `decode_tiles`), and
the torch path; plus one prefill. Decode is memory-bound, so each time is also given as the
K/V bandwidth it reaches (H100 SXM peaks near 3.35 TB/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu.attention import decode_attention_torch, prefill_attention_torch  # noqa: E402
from gpu.kernels import (  # noqa: E402
    DecodeTiles,
    decode_attention_triton,
    prefill_attention_triton,
)
from tests.gpu.paged_batch import PagedBatch, make_paged_batch  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
"""Against a float64 reference: fp32 leaves room for summation order over thousands of keys;
16-bit dtypes round the output and the softmax weights (before P @ V) to their own precision."""
SCALE = 128**-0.5


def max_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return (out.double() - expected).abs().max().item()


def check_kernels(dtype: torch.dtype) -> list[dict]:
    """Both kernels on mixed lengths (not block multiples, a long one among short ones), GQA 4."""
    heads = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": dtype,
             "device": "cuda"}
    results = []
    prefill = make_paged_batch(prefills=[(1000, 1000), (300, 1811), (1, 77), (37, 37)],
                               **heads, seed=1)
    as64 = [t.double() for t in (prefill.q, prefill.k_cache, prefill.v_cache)]
    expected = prefill_attention_torch(*as64, prefill.meta, SCALE)
    out = prefill_attention_triton(prefill.q, prefill.k_cache, prefill.v_cache, prefill.meta,
                                   SCALE)
    results.append({"kernel": "prefill", "max_abs_error": max_error(out, expected)})
    decode = make_paged_batch(decode_lens=[4000, 1, 17, 16, 2048, 333, 5, 1024], **heads, seed=2)
    meta = decode.meta
    as64 = [t.double() for t in (decode.q, decode.k_cache, decode.v_cache)]
    expected = decode_attention_torch(*as64, meta.block_tables, meta.seq_lens,
                                      meta.max_seq_len, SCALE)
    for splits in (1, 7, None):
        out = decode_attention_triton(decode.q, decode.k_cache, decode.v_cache, meta.block_tables,
                                      meta.seq_lens, meta.max_seq_len, SCALE,
                                      tiles=DecodeTiles(num_splits=splits) if splits else None)
        results.append({"kernel": f"decode(splits={splits or 'auto'})",
                        "max_abs_error": max_error(out, expected)})
    for r in results:
        r.update(dtype=str(dtype), tolerance=TOLERANCE[dtype],
                 ok=r["max_abs_error"] <= TOLERANCE[dtype])
    return results


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> dict:
    """Median and min over `iters` runs, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(iters)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in pairs]
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def decode_timings(batch: PagedBatch, warmup: int, iters: int) -> list[dict]:
    meta = batch.meta
    args = (batch.q, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens,
            meta.max_seq_len, SCALE)
    kv_bytes = 2 * sum(meta.seq_lens_host) * batch.k_cache[0, 0].numel() * batch.q.itemsize
    variants: list[tuple[str, Callable[[], object]]] = [
        ("triton default", lambda: decode_attention_triton(*args)),
        ("torch", lambda: decode_attention_torch(*args)),
    ]
    for block_n, warps, stages in [(32, 4, 2), (64, 4, 2), (64, 8, 2), (64, 4, 3), (128, 8, 2)]:
        for splits in (1, 2, 4):
            tiles = DecodeTiles(block_n=block_n, num_warps=warps, num_stages=stages,
                                num_splits=splits)
            variants.append((f"triton {tiles}",
                             lambda tiles=tiles: decode_attention_triton(*args, tiles=tiles)))
    results = []
    for name, fn in variants:
        try:
            timing = time_ms(fn, warmup, iters)
        except Exception as exc:  # a tile shape that does not compile is a result, not a crash
            results.append({"variant": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        gbps = kv_bytes / (timing["median_ms"] * 1e-3) / 1e9
        results.append({"variant": name, **timing, "kv_gb_per_s": round(gbps, 1)})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
              "on CPU run tests/gpu/test_kernels.py, which uses the Triton interpreter.",
              file=sys.stderr)
        return 2

    import triton

    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": triton.__version__}
    if not args.skip_checks:
        report["checks"] = [r for name in DTYPES for r in check_kernels(DTYPES[name])]
    dtype = DTYPES[args.dtype]
    shape = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": dtype,
             "block_size": args.block_size, "device": "cuda"}
    blocks = args.batch * -(-args.context // args.block_size)
    decode = make_paged_batch(decode_lens=[args.context] * args.batch, arena_blocks=blocks + 64,
                              **shape, seed=3)
    report["decode"] = {"batch": args.batch, "context": args.context, "dtype": args.dtype,
                        "heads": "32q/8kv", "head_dim": 128,
                        "timings": decode_timings(decode, args.warmup, args.iters)}
    del decode
    prefill = make_paged_batch(prefills=[(args.context, args.context)] * 4, **shape, seed=4)
    report["prefill"] = {"prompts": 4, "tokens_each": args.context, "dtype": args.dtype,
                         **time_ms(lambda: prefill_attention_triton(
                             prefill.q, prefill.k_cache, prefill.v_cache, prefill.meta, SCALE),
                             args.warmup, args.iters)}
    print(json.dumps(report, indent=2))
    return 0 if all(c["ok"] for c in report.get("checks", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
