"""Write the shipped sim profiles from the vidur GPU measurements in ../shared/profiles/vidur.

    python bench/derive_vidur_profiles.py [--vidur ../shared/profiles/vidur] [--out sim/profiles]

* llama3-8b-a100: the ready fit `fitted_llama3_8b_a100_iteration_model.json` (its variant with
  the prefix-attention term), as `engine.cost_model.LLAMA3_8B_A100`.
* llama2-7b-{a100,h100,a40}: vidur has Llama-2-7B MLP (linear-op) profiles on the three GPUs but
  no Llama-2-7B attention profile here. Rows are composed the way vidur composes an iteration,
  32 x (linear ops at the batch's token count + attention), with:
  - linear ops measured: the nine op medians of that GPU's Llama-2-7B mlp.csv (TP1), interpolated;
  - attention taken from the Llama-3-8B A100 attention subset and scaled: decode attention and
    the KV write read/write bytes, so x4 for Llama-2-7B's 32 KV heads against Llama-3's 8;
    prefill attention has the same FLOPs (32 query heads x 128 either way), x1;
  - moved to the target GPU by ratios measured in the same MLP files: memory-bound work (decode
    attention, KV write) by the linear-op ratio at 1 token (weight reads: bandwidth), prefill
    attention by the ratio at 2048 tokens (compute-bound GEMMs).
  Only rows within Llama-2-7B's 4096-token context are used (its MLP files stop there).
  Then the same relative-error least-squares fit as `shunter profile fit`. As a check, the
  method applied to Llama-3-8B on A100 (measured attention, ratios 1) is compared with the
  ready fit.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import gzip
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.cost_model import LLAMA3_8B_A100, BatchShape  # noqa: E402
from sim.copy_costs import PCIE4_X16, PCIE5_X16  # noqa: E402
from sim.fit import fit_cost_model  # noqa: E402
from sim.profile import ModelShape, Profile, save_profile  # noqa: E402

OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
LAYERS = 32

LLAMA3_8B = ModelShape(name="Meta-Llama-3-8B", num_layers=32, hidden_size=4096,
                       intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128,
                       vocab_size=128256, max_context=16384)
LLAMA2_7B = ModelShape(name="Llama-2-7b-hf", num_layers=32, hidden_size=4096,
                       intermediate_size=11008, num_heads=32, num_kv_heads=32, head_dim=128,
                       vocab_size=32000, max_context=4096)
# Host link: FastSwitch's published copy costs (sim/copy_costs.py): PCIe 4.0 x16 for the A100
# and A40 hosts, PCIe 5.0 x16 for the H100.
LINKS = {"a100": PCIE4_X16, "a40": PCIE4_X16, "h100": PCIE5_X16}
MEMORY_GIB = {"a100": 80.0, "a40": 48.0, "h100": 80.0}


def read_csv(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        sys.exit(f"missing {path}: pass the vidur profile folder with --vidur")
    with io.TextIOWrapper(gzip.open(path), encoding="utf-8") as f:
        return list(csv.DictReader(f))


def linear_ops(vidur: Path, gpu: str, model: str):
    """ms per layer of the nine linear ops at n tokens (TP1), linearly interpolated."""
    rows = [r for r in read_csv(vidur / "compute" / gpu / "meta-llama" / model / "mlp.csv.gz")
            if r["num_tensor_parallel_workers"] == "1"]
    pts: dict[int, list[float]] = {}
    for r in rows:
        pts.setdefault(int(r["num_tokens"]), []).append(
            sum(float(r[f"time_stats.{op}.median"]) for op in OPS))
    xs = sorted(pts)
    ys = [sum(pts[x]) / len(pts[x]) for x in xs]

    def at(n: float) -> float:
        i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)
        x0, x1 = xs[i - 1], xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (n - x0) / (x1 - x0)
    return at


def attention_rows(vidur: Path):
    """(shape, tokens, kv_save, prefill, decode) from the Llama-3-8B A100 subset, ms per layer."""
    path = vidur / "compute/a100/meta-llama/Meta-Llama-3-8B/attention_subset_tp1_transcribed.csv.gz"
    out = []
    for r in read_csv(path):
        cells = [r[f"time_stats.{k}.median"] for k in ("attn_kv_cache_save", "attn_prefill", "attn_decode")]
        if "" in cells:
            continue  # cut off at a window edge in the transcription
        save, pre, dec = map(float, cells)
        b, p, kv = int(r["batch_size"]), int(r["prefill_chunk_size"]), int(r["kv_cache_size"])
        if r["is_prefill"] == "True":
            shape = BatchShape.of([(kv, p)])
            tokens = p
        else:
            shape = BatchShape(decode_seqs=b, decode_context=b * (kv + 1))
            tokens = b
        out.append((shape, tokens, save, pre, dec))
    return out


def compose(attn, linear, *, mem: float, flop: float, kv_heads_ratio: float,
            max_tokens: int | None = None):
    """Rows within `max_tokens` (batch tokens and per-sequence context): the Llama-2-7B MLP
    files stop at 4096 tokens, its context length."""
    rows = []
    for shape, tokens, save, pre, dec in attn:
        context = shape.prefill_tokens + shape.prefill_prefix // max(1, shape.prefill_tokens)
        if shape.decode_seqs:
            context = shape.decode_context // shape.decode_seqs
        if max_tokens is not None and max(tokens, context) > max_tokens:
            continue
        rows.append((shape, LAYERS * (linear(tokens) + (save + dec) * kv_heads_ratio * mem
                                      + pre * flop)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parent.parent
    ap.add_argument("--vidur", type=Path, default=root.parent / "shared" / "profiles" / "vidur")
    ap.add_argument("--out", type=Path, default=root / "engine" / "sim" / "profiles")
    args = ap.parse_args()
    attn = attention_rows(args.vidur)
    report = {}

    fitted = json.loads((args.vidur / "fitted_llama3_8b_a100_iteration_model.json").read_text())
    l3 = Profile(name="llama3-8b-a100", model=LLAMA3_8B, gpu="A100-80GB", gpu_memory_gib=80.0,
                 cost=LLAMA3_8B_A100, link=LINKS["a100"],
                 source="shared/profiles/vidur/fitted_llama3_8b_a100_iteration_model.json "
                        "(variant_with_prefill_context_term): a fit of microsoft/vidur's "
                        "Llama-3-8B A100 TP1 MLP and attention measurements; max_context is the "
                        "16k the attention data covers")
    save_profile(l3, args.out / "llama3-8b-a100.json")
    check = fit_cost_model(compose(attn, linear_ops(args.vidur, "a100", "Meta-Llama-3-8B"),
                                   mem=1.0, flop=1.0, kv_heads_ratio=1.0), source="check")
    report["llama3-8b-a100 method check"] = {
        "refit": {k: v for k, v in vars_of(check.cost).items()},
        "shipped_fit": fitted["variant_with_prefill_context_term"]["coefficients"],
        "mean_relative_error": check.mean_relative_error}

    l2_a100 = linear_ops(args.vidur, "a100", "Llama-2-7b-hf")
    for gpu in ("a100", "h100", "a40"):
        lin = linear_ops(args.vidur, gpu, "Llama-2-7b-hf")
        mem, flop = lin(1) / l2_a100(1), lin(2048) / l2_a100(2048)
        fit = fit_cost_model(compose(attn, lin, mem=mem, flop=flop, kv_heads_ratio=4.0,
                                     max_tokens=LLAMA2_7B.max_context), source="")
        source = (f"derived from microsoft/vidur: Llama-2-7b-hf {gpu.upper()} TP1 mlp.csv "
                  f"(measured linear ops) + Llama-3-8B A100 attention subset scaled x4 for 32 KV "
                  f"heads and moved to {gpu.upper()} by measured linear-op ratios (x{mem:.2f} "
                  f"memory-bound at 1 token, x{flop:.2f} compute-bound at 2048 tokens); relative-"
                  f"error fit over {fit.rows} composed rows, mean error "
                  f"{fit.mean_relative_error:.1%} (see bench/derive_vidur_profiles.py)")
        prof = Profile(name=f"llama2-7b-{gpu}", model=LLAMA2_7B, gpu=gpu.upper(),
                       gpu_memory_gib=MEMORY_GIB[gpu], cost=fit.cost, link=LINKS[gpu], source=source)
        save_profile(prof, args.out / f"llama2-7b-{gpu}.json")
        report[prof.name] = {"mem_ratio": mem, "flop_ratio": flop,
                             "mean_relative_error": fit.mean_relative_error,
                             "coefficients": vars_of(fit.cost)}
    print(json.dumps(report, indent=1))


def vars_of(cost) -> dict[str, float]:
    return {k: getattr(cost, k) for k in ("a_ms", "b_ms_per_prefill_token", "c_ms_per_prefill_token_sq",
                                          "d_ms_per_decode_seq", "e_ms_per_decode_context_token",
                                          "f_ms_per_prefill_prefix_token")}


if __name__ == "__main__":
    main()
