"""Write sim/profiles/llama3-8b-a10.json: Llama-3-8B on an NVIDIA A10 24GB, FastSwitch's testbed
(§2.2, §4), which vidur did not measure. Derived, as issue 13 asks, from what was measured on the
A40 (the same GA102 chip) and moved to the A10 by published spec ratios:

* iteration times: vidur's Llama-3-8B A100 rows (measured linear ops + attention), moved to the
  A40 by the A40/A100 ratio of vidur's Llama-2-7B linear ops measured on both GPUs at the same
  token count (memory-bound attention and KV writes by the ratio at 1 token, prefill attention by
  the one at 2048), then to the A10 by NVIDIA's datasheets: memory bandwidth 696 -> 600 GB/s for
  memory-bound work, dense FP16 tensor throughput 149.7 -> 125 TFLOPS for compute-bound work (log-
  interpolated in between for linear ops at n tokens); refitted like `shunter profile fit`;
* KV pool: 24 GB minus the weights and the activations, at vLLM's default 0.9 memory
  utilization (the paper's baseline is vLLM 0.3.3);
* host link: `sim/copy_costs.py` (FastSwitch §2.2's figures).

    python bench/derive_a10_profile.py [--vidur ../shared/profiles/vidur] [--out sim/profiles]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from derive_vidur_profiles import LLAMA3_8B, attention_rows, linear_ops, vars_of

from sim.copy_costs import PCIE4_X16, link_source
from sim.fit import fit_cost_model
from sim.profile import Profile, save_profile

A40_BANDWIDTH_GB_S, A10_BANDWIDTH_GB_S = 696.0, 600.0
"""GDDR6 bandwidth, NVIDIA A40 and A10 datasheets."""
A40_FP16_TFLOPS, A10_FP16_TFLOPS = 149.7, 125.0
"""Dense FP16 tensor-core peak, NVIDIA A40 and A10 datasheets."""
A10_MEMORY_GB = 24.0
"""A10 device memory (datasheet: 24 GB GDDR6), in 1e9 bytes."""
MEMORY_UTILIZATION = 0.9
"""vLLM's default `gpu_memory_utilization` (vLLM 0.3.3, the paper's baseline)."""
MAX_BATCHED_TOKENS, MAX_NUM_SEQS = 2048, 64
"""The ladder's step limits (bench/fastswitch_ladder.py): the activation peak is sized for them."""


def activation_bytes(tokens: int, seqs: int) -> int:
    """Peak activations of a step of `tokens` tokens sampling `seqs` sequences, Llama-3-8B in
    fp16: the residual stream, the attention input/output and q/k/v (5 hidden-sized buffers a
    token), gate, up and activated intermediate (3 intermediate-sized), and fp32 logits for the
    sampled sequences. An estimate by shapes; vLLM measures it with a profiling step."""
    m = LLAMA3_8B
    per_token = (5 * m.hidden_size + 3 * m.intermediate_size) * m.dtype_bytes
    return tokens * per_token + seqs * m.vocab_size * 4


def a10_ratio(tokens: float) -> float:
    """A10 time / A40 time for linear ops at `tokens` tokens: the bandwidth ratio at 1 token
    (weight reads), the FLOP ratio from 2048 tokens on, log-interpolated between."""
    mem = A40_BANDWIDTH_GB_S / A10_BANDWIDTH_GB_S
    flop = A40_FP16_TFLOPS / A10_FP16_TFLOPS
    share = min(1.0, max(0.0, math.log2(max(tokens, 1.0)) / 11.0))
    return mem + (flop - mem) * share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vidur", type=Path, default=ROOT.parent / "shared" / "profiles" / "vidur")
    ap.add_argument("--out", type=Path, default=ROOT / "sim" / "profiles")
    args = ap.parse_args()
    l3_a100 = linear_ops(args.vidur, "a100", "Meta-Llama-3-8B")
    l2_a100 = linear_ops(args.vidur, "a100", "Llama-2-7b-hf")
    l2_a40 = linear_ops(args.vidur, "a40", "Llama-2-7b-hf")

    def a40_ratio(n: float) -> float:  # measured to 4096 tokens (Llama-2-7B's context)
        n = min(n, 4096.0)
        return l2_a40(n) / l2_a100(n)

    mem40, flop40 = a40_ratio(1), a40_ratio(2048)
    mem10 = A40_BANDWIDTH_GB_S / A10_BANDWIDTH_GB_S
    flop10 = A40_FP16_TFLOPS / A10_FP16_TFLOPS
    rows = []
    for shape, tokens, save, pre, dec in attention_rows(args.vidur):
        linear = l3_a100(tokens) * a40_ratio(tokens) * a10_ratio(tokens)
        attn = (save + dec) * mem40 * mem10 + pre * flop40 * flop10
        rows.append((shape, LLAMA3_8B.num_layers * (linear + attn)))
    fit = fit_cost_model(rows, source="")
    act = activation_bytes(MAX_BATCHED_TOKENS, MAX_NUM_SEQS)
    source = (
        f"derived (bench/derive_a10_profile.py), vidur has no A10: Llama-3-8B A100 rows of "
        f"microsoft/vidur (measured linear ops + attention) moved to the A40 (GA102, as the A10) "
        f"by vidur's measured Llama-2-7B A40/A100 linear-op ratios (x{mem40:.2f} at 1 token, "
        f"x{flop40:.2f} at 2048), then to the A10 by datasheet ratios (memory bandwidth 696/600 "
        f"GB/s = x{mem10:.3f} for memory-bound work, dense FP16 149.7/125 TFLOPS = x{flop10:.3f} "
        f"for compute-bound); relative-error fit over {fit.rows} rows, mean error "
        f"{fit.mean_relative_error:.1%}. Memory: 24 GB x {MEMORY_UTILIZATION} (vLLM's default) "
        f"minus {LLAMA3_8B.weight_bytes / 1e9:.2f} GB of weights and {act / 1e9:.2f} GB of "
        f"activations (a {MAX_BATCHED_TOKENS}-token step sampling {MAX_NUM_SEQS} sequences).")
    profile = Profile(name="llama3-8b-a10", model=LLAMA3_8B, gpu="A10-24GB",
                      gpu_memory_gib=A10_MEMORY_GB * 1e9 / 2**30, cost=fit.cost,
                      link=PCIE4_X16, memory_utilization=MEMORY_UTILIZATION,
                      activation_gib=act / 2**30, source=source)
    save_profile(profile, args.out / "llama3-8b-a10.json")
    print(json.dumps({"coefficients": vars_of(fit.cost), "mean_relative_error":
                      fit.mean_relative_error, "num_blocks_16": profile.num_blocks(16),
                      "link": link_source(PCIE4_X16)}, indent=1))


if __name__ == "__main__":
    main()
