"""Training the model shipped in `gpu/default_model/`: a small Llama trained on the Python
standard library's own sources, so `shunter demo` shows Python-like text with nothing downloaded.

    python -m tools.train_default --out gpu/default_model [--minutes 12] [--seed 0]

The data is the code of the `.py` files of the running interpreter's standard library (test
suites, IDLE, codec tables, the build's `_sysconfigdata` and very large files left out; docstrings
and comment lines stripped), split into training and held-out files by a hash of each file's
relative path. The standard library differs a little between Python versions and
builds, so another interpreter trains on slightly different text: the shipped weights were
trained on CPython 3.11.7. With a fixed seed the data order, the initial weights and (with
`--steps`) the schedule are fixed too; by default the schedule follows the wall clock, so a busy
machine takes fewer steps. The whole run, tokenizer included, fits in 15 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import math
import os
import platform
import re
import resource
import sys
import sysconfig
import time
import tokenize
import zlib
from collections.abc import Sequence
from pathlib import Path

import attrs
import tokenizers
import torch
import torch.nn.functional as F

from gpu.config import DTYPES, ModelConfig
from gpu.make_model import (
    BOS_ID,
    EOS_ID,
    SPECIAL_TOKENS,
    add_bos_on_encode,
    random_model_config,
    write_generation_config,
)
from gpu.model import CausalLM
from gpu.tokenizer import train_byte_level_bpe

_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "encodings", "pydoc_data"})
"""Test suites and IDLE are skipped as asked of the corpus; `encodings` is mostly charmap tables
and `pydoc_data` one 750 kB string: data, not code."""
_MAX_FILE_BYTES = 200_000
_HELDOUT_BUCKETS = 20
"""A file is held out when crc32(relative path) % this == 0: about 5 %, stable across builds."""
SAMPLE_PROMPTS = ("def ", "import os\n", "class ")


@attrs.frozen(kw_only=True)
class TrainConfig:
    """Model shape and optimisation settings of one training run."""

    vocab: int = 4096
    hidden: int = 192
    layers: int = 4
    heads: int = 6
    kv_heads: int = 2
    intermediate: int = 512
    max_positions: int = 1024
    seq_len: int = 256
    batch: int = 4
    """Small batches, many steps: in a budget this short they learn more per token."""
    peak_lr: float = 3e-3
    final_lr_ratio: float = 0.1
    """The cosine decays the learning rate to peak_lr * this at the end of the budget."""
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 250
    """Steps between held-out evaluations (and progress lines)."""
    eval_windows: int = 32
    space_split: float = 0.05
    """Share of space-led tokens spelled as two (see `split_leading_spaces`)."""
    save_dtype: str = "bfloat16"
    """bf16 keeps the directory under 8 MB; Shunter upcasts to float32 on CPU."""


def corpus_files(root: Path) -> tuple[list[Path], list[Path]]:
    """The standard library's `.py` files in sorted order, as (training, held-out)."""
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if (_SKIP_DIRS & set(rel.parts) or path.stat().st_size > _MAX_FILE_BYTES
                or path.name.startswith("_sysconfigdata")):  # this build's paths and flags
            continue
        held = zlib.crc32(rel.as_posix().encode()) % _HELDOUT_BUCKETS == 0
        (heldout if held else train).append(path)
    return train, heldout


def read_texts(paths: Sequence[Path]) -> list[str]:
    """The code of each file (see `code_only`); the odd file that is not UTF-8 is skipped."""
    texts = []
    for path in paths:
        try:
            texts.append(code_only(path.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    return texts


def code_only(source: str) -> str:
    """`source` without its docstrings and whole-line comments, and with at most two blank
    lines in a row. A third of the standard library is prose; a model this small trained this
    briefly learns code faster without it, and greedy decoding in a docstring degenerates into
    "the the the". Source that does not parse is returned unchanged."""
    try:
        drop = _docstring_lines(ast.parse(source)) | _comment_lines(source)
    except (SyntaxError, ValueError, tokenize.TokenError):
        return source
    lines = source.splitlines(keepends=True)
    text = "".join(line for i, line in enumerate(lines, 1) if i not in drop)
    return re.sub(r"\n(?:[ \t]*\n){3,}", "\n\n\n", text).lstrip("\n")


def _docstring_lines(tree: ast.Module) -> set[int]:
    """Line numbers (from 1) of docstrings, except those that are a whole body (the body
    would be left empty)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        first = node.body[0]
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def _comment_lines(source: str) -> set[int]:
    """Line numbers of lines holding nothing but a comment (tokenize knows what is a string)."""
    return {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT and not tok.line[:tok.start[1]].strip()}


def train_tokenizer(texts: Sequence[str], vocab: int) -> tokenizers.Tokenizer:
    """Byte-level BPE on the training files; `encode` adds <|bos|> as Llama tokenizers do."""
    tok = train_byte_level_bpe(texts, vocab, special_tokens=SPECIAL_TOKENS)
    add_bos_on_encode(tok)
    return tok


def token_stream(tok: tokenizers.Tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """Every file as <|bos|> file <|eos|>, concatenated: int64 [N]."""
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        ids += [BOS_ID, *enc.ids, EOS_ID]
    return torch.tensor(ids, dtype=torch.int64)


def split_leading_spaces(stream: torch.Tensor, tok: tokenizers.Tokenizer, rate: float,
                         gen: torch.Generator) -> torch.Tensor:
    """Spell a random `rate` of the tokens " name" as " " + "name" (same text, other ids).

    Byte-level BPE glues a space to the word after it, so a prompt ending in a space ("def ")
    ends in a lone " " token that clean training text never follows with a word: the model
    would answer with a second space. Seeing the split spelling teaches it to continue."""
    vocab = tok.get_vocab()
    rest = torch.full((tok.get_vocab_size(),), -1, dtype=torch.int64)  # id of token[1:]
    for token, i in vocab.items():
        if token.startswith("Ġ") and token[1:] in vocab:
            rest[i] = vocab[token[1:]]
    chosen = (rest[stream] >= 0) & (torch.rand(len(stream), generator=gen) < rate)
    counts = 1 + chosen.long()
    out = stream.repeat_interleave(counts)
    first = (torch.cumsum(counts, 0) - counts)[chosen]  # where each chosen token now starts
    out[first + 1] = rest[stream[chosen]]
    out[first] = vocab["Ġ"]
    return out


def lm_loss(model: CausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over windows [B, S + 1]."""
    logits = model.forward_dense(windows[:, :-1])  # [B, S, V]
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model: CausalLM, windows: torch.Tensor, batch: int = 8) -> float:
    losses = [lm_loss(model, windows[i:i + batch]).item() for i in range(0, len(windows), batch)]
    return sum(losses) / len(losses)


def fixed_windows(stream: torch.Tensor, count: int, seq_len: int) -> torch.Tensor:
    """`count` evenly spaced windows [count, seq_len + 1]: the same ones in every evaluation."""
    stride = max(1, (len(stream) - seq_len - 1) // count)
    return torch.stack([stream[i * stride:i * stride + seq_len + 1] for i in range(count)])


def learning_rate(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup over the first steps, then cosine decay over the budget (progress 0..1)."""
    if step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.peak_lr * (cfg.final_lr_ratio + (1 - cfg.final_lr_ratio) * cosine)


def make_optimizer(model: CausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; matrices decay, norm weights do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=(0.9, 0.95), eps=1e-8)


def train(model: CausalLM, cfg: TrainConfig, stream: torch.Tensor, heldout: torch.Tensor, *,
          seed: int, seconds: float, max_steps: int | None) -> dict[str, object]:
    """Train until the time budget (or max_steps) runs out; returns the run's statistics."""
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(model, cfg)
    began, step, recent, history = time.perf_counter(), 0, [], []
    while True:
        elapsed = time.perf_counter() - began
        progress = step / max_steps if max_steps else elapsed / seconds
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step, progress)
        starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.batch,), generator=gen)
        windows = torch.stack([stream[s:s + cfg.seq_len + 1] for s in starts.tolist()])
        loss = lm_loss(model, windows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        recent = (recent + [loss.item()])[-cfg.eval_every:]
        if step % cfg.eval_every == 0:
            history.append(_report(model, step, elapsed, recent, heldout))
    return {"steps": step, "train_seconds": round(time.perf_counter() - began, 1),
            "tokens_seen": step * cfg.batch * cfg.seq_len,
            "final_train_loss": round(sum(recent) / len(recent), 4), "history": history}


def _report(model: CausalLM, step: int, elapsed: float, recent: list[float],
            heldout: torch.Tensor) -> dict[str, float]:
    row = {"step": step, "seconds": round(elapsed, 1),
           "train_loss": round(sum(recent) / len(recent), 4),
           "heldout_loss": round(heldout_loss(model, heldout), 4)}
    print(f"step {step:5d}  {elapsed:6.0f}s  train {row['train_loss']:.3f}  "
          f"held-out {row['heldout_loss']:.3f}", flush=True)
    return row


@torch.no_grad()
def greedy(model: CausalLM, tok: tokenizers.Tokenizer, prompt: str, max_tokens: int = 48) -> str:
    """Greedy continuation through the dense forward (the training model has no KV cache)."""
    ids = tok.encode(prompt).ids
    for _ in range(max_tokens):
        nxt = int(model.forward_dense(torch.tensor([ids]))[0, -1].argmax())
        if nxt == EOS_ID:
            break
        ids.append(nxt)
    return tok.decode(ids, skip_special_tokens=True)


def round_weights(model: CausalLM, dtype: torch.dtype) -> None:
    """Round the parameters to the dtype they are saved in (and keep them in that dtype)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


@attrs.frozen(kw_only=True)
class Corpus:
    """The tokenized data of one run."""

    tokenizer: tokenizers.Tokenizer
    train: torch.Tensor
    """int64 [N]: the training files, with some leading spaces split off."""
    heldout: torch.Tensor
    """int64 [eval_windows, seq_len + 1]: fixed windows of the held-out files."""
    stats: dict[str, object]
    """File, byte and token counts for the log."""


def prepare_corpus(cfg: TrainConfig, root: Path, seed: int) -> Corpus:
    train_files, heldout_files = corpus_files(root)
    train_texts, heldout_texts = read_texts(train_files), read_texts(heldout_files)
    tok = train_tokenizer(train_texts, cfg.vocab)
    stream, heldout = token_stream(tok, train_texts), token_stream(tok, heldout_texts)
    gen = torch.Generator().manual_seed(seed)
    stats = {"train_files": len(train_texts), "heldout_files": len(heldout_texts),
             "train_code_bytes": sum(len(t.encode()) for t in train_texts),
             "heldout_code_bytes": sum(len(t.encode()) for t in heldout_texts),
             "train_tokens": stream.numel(), "heldout_tokens": heldout.numel()}
    return Corpus(tokenizer=tok, train=split_leading_spaces(stream, tok, cfg.space_split, gen),
                  heldout=fixed_windows(heldout, cfg.eval_windows, cfg.seq_len), stats=stats)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(2)
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    cfg, root = TrainConfig(), Path(sysconfig.get_paths()["stdlib"])
    corpus = prepare_corpus(cfg, root, args.seed)
    print(f"data ready in {time.perf_counter() - began:.0f}s: {corpus.stats}", flush=True)
    model = CausalLM.init_random(_model_config(cfg), seed=args.seed)
    stats = train(model, cfg, corpus.train, corpus.heldout, seed=args.seed,
                  seconds=args.minutes * 60, max_steps=args.steps)
    fp32_loss = heldout_loss(model, corpus.heldout)
    round_weights(model, DTYPES[cfg.save_dtype])  # evaluate and sample what is shipped
    round_weights(model, torch.float32)
    shipped_loss = heldout_loss(model, corpus.heldout)
    samples = {p: greedy(model, corpus.tokenizer, p) for p in SAMPLE_PROMPTS}
    round_weights(model, DTYPES[cfg.save_dtype])
    out = _write_dir(model, corpus.tokenizer, Path(args.out))
    log = {
        "python": platform.python_version(), "torch": torch.__version__, "stdlib": str(root),
        "seed": args.seed, "minutes": args.minutes, "max_steps": args.steps,
        "train_config": attrs.asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "data": corpus.stats, **stats,
        "final_heldout_loss_fp32": round(fp32_loss, 4),
        "final_heldout_loss_shipped": round(shipped_loss, 4),
        "wall_seconds": round(time.perf_counter() - began, 1),
        "cpu_share": _cpu_share(time.perf_counter() - began),
        "load_average_1min_before_after": [round(load_before, 2),
                                           round(os.getloadavg()[0], 2)],
        "samples": samples,
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"held-out loss {fp32_loss:.3f} (fp32), {shipped_loss:.3f} ({cfg.save_dtype}); "
          f"{stats['steps']} steps; {log['wall_seconds']:.0f}s in all; wrote {out}")
    for prompt, text in samples.items():
        print(f"--- {prompt!r}\n{text}")


def _cpu_share(wall: float) -> float:
    """This process's CPU time over what 2 threads could have used: well under 1.0 means other
    work on the machine slowed the run (the schedule follows the clock, so it took fewer
    steps)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return round((usage.ru_utime + usage.ru_stime) / (2 * wall), 2)


def _model_config(cfg: TrainConfig) -> ModelConfig:
    return random_model_config(
        arch="llama", layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads,
        kv_heads=cfg.kv_heads, vocab=cfg.vocab, intermediate=cfg.intermediate,
        dtype=cfg.save_dtype, tie_embeddings=True, max_position_embeddings=cfg.max_positions)


def _write_dir(model: CausalLM, tok: tokenizers.Tokenizer, out: Path) -> Path:
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True))
    write_generation_config(out)
    return out


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="model directory to write")
    ap.add_argument("--minutes", type=float, default=12.0,
                    help="training time budget (default 12; data and saving add about a minute)")
    ap.add_argument("--steps", type=int, default=None,
                    help="train exactly this many steps instead (a reproducible schedule)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
