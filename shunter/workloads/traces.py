"""Readers for the real traces in `../shared/traces` (see its README), read in place with gzip.

Each reader returns requests in arrival order with times in seconds from the trace's first
request; the length tables (ShareGPT, arXiv) have no times and return (prompt, output) pairs.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from datetime import datetime
from pathlib import Path

from engine.errors import ShunterError
from shunter.workloads.workload import RequestSpec

DEFAULT_TRACES_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
"""`../shared/traces` relative to the project root."""

FILES = {
    "azure-conv": "azure2023_AzureLLMInferenceTrace_conv.csv.gz",
    "azure-code": "azure2023_AzureLLMInferenceTrace_code.csv.gz",
    "mooncake-conv": "mooncake_fast25_conversation_trace.jsonl.gz",
    "mooncake-synth": "mooncake_fast25_synthetic_trace.jsonl.gz",
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv.gz",
    "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv.gz",
    "bwb": "bwb_stats_llama2_tokenizer_filtered_v2.csv.gz",
}

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per `hash_ids` entry in the Mooncake traces."""


class TraceError(ShunterError):
    """A trace file is missing or malformed."""


def trace_path(traces_dir: Path, name: str) -> Path:
    path = Path(traces_dir) / FILES[name]
    if not path.is_file():
        raise TraceError(
            f"workload {name} needs {path}, which does not exist; pass the folder of the shared "
            f"traces with --traces (default: {DEFAULT_TRACES_DIR})")
    return path


def _open(path: Path) -> io.TextIOBase:
    return io.TextIOWrapper(gzip.open(path), encoding="utf-8")


def read_azure(traces_dir: Path, name: str) -> list[RequestSpec]:
    """Azure LLM inference trace 2023: `TIMESTAMP,ContextTokens,GeneratedTokens`."""
    path = trace_path(traces_dir, name)
    rows = []
    with _open(path) as f:
        for n, row in enumerate(csv.DictReader(f), 2):
            try:
                t = datetime.fromisoformat(row["TIMESTAMP"][:26])
                rows.append((t, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            except (KeyError, ValueError) as exc:
                raise TraceError(f"{path}:{n}: cannot read row: {exc}") from None
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [RequestSpec(index=i, arrival_s=(t - t0).total_seconds(), prompt_tokens=max(1, p),
                        output_tokens=max(1, o))
            for i, (t, p, o) in enumerate(rows)]


def read_mooncake(traces_dir: Path, name: str) -> list[RequestSpec]:
    """Mooncake FAST'25 traces: `timestamp` (ms), lengths and `hash_ids`, one id per 512-token
    prefix block (equal ids = equal prefix).

    Every request gets as parent the latest earlier request with which it shares the longest
    prefix of blocks, and its prompt starts with that many tokens of the parent's context. When
    the shared blocks cover all of the parent's full prompt blocks, it is the parent's next turn:
    its shared prefix runs into the parent's output (a block hash covers the parent's last,
    partial prompt block together with the first output tokens), so it is sent only once the
    parent has finished, in the parent's conversation. A parent needs two full prompt blocks
    for that: many unrelated requests share only a first block (a common system prompt).
    """
    path = trace_path(traces_dir, name)
    with _open(path) as f:
        rows = []
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                rows.append((float(r["timestamp"]) / 1000.0, int(r["input_length"]),
                             int(r["output_length"]), r["hash_ids"]))
            except (KeyError, ValueError, TypeError) as exc:
                raise TraceError(f"{path}:{n}: cannot read line: {exc}") from None
    rows.sort(key=lambda r: r[0])
    return link_prefixes(rows, MOONCAKE_BLOCK_TOKENS)


def link_prefixes(rows: list[tuple[float, int, int, list[int]]], block: int) -> list[RequestSpec]:
    """(time s, input, output, hash ids) in arrival order -> specs with parents (see above)."""
    prime, mod = 1_000_003, (1 << 61) - 1
    latest: dict[tuple[int, int], int] = {}
    conv: list[str] = []
    specs = []
    t0 = rows[0][0] if rows else 0.0
    for i, (t, p, o, ids) in enumerate(rows):
        h, prefix_hashes = 0, []
        for x in ids:  # a rolling hash per prefix length: O(len) per request
            h = (h * prime + x + 1) % mod
            prefix_hashes.append(h)
        parent, shared_blocks = None, 0
        for k in range(len(prefix_hashes), 0, -1):
            j = latest.get((k, prefix_hashes[k - 1]))
            if j is not None:
                parent, shared_blocks = j, k
                break
        for k, ph in enumerate(prefix_hashes, 1):
            latest[(k, ph)] = i
        conv_id, after, shared = f"c{i}", None, 0
        if parent is not None:
            pp = rows[parent][1]
            shared = min(shared_blocks * block, p)
            if pp >= 2 * block and shared_blocks >= pp // block:
                conv_id, after = conv[parent], 0.0
                shared = min(shared, pp + rows[parent][2])
            else:
                shared = min(shared, pp)
        conv.append(conv_id)
        specs.append(RequestSpec(
            index=i, arrival_s=t - t0, prompt_tokens=max(1, p), output_tokens=max(1, o),
            conversation_id=conv_id, parent=parent if shared else None, shared_tokens=shared,
            after_parent_s=after if shared else None))
    return specs


def read_length_table(traces_dir: Path, name: str) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) rows of a length table (ShareGPT, arXiv, BWB)."""
    path = trace_path(traces_dir, name)
    out = []
    with _open(path) as f:
        for n, row in enumerate(csv.DictReader(f), 2):
            try:
                out.append((max(1, int(row["num_prefill_tokens"])),
                            max(1, int(row["num_decode_tokens"]))))
            except (KeyError, ValueError) as exc:
                raise TraceError(f"{path}:{n}: cannot read row: {exc}") from None
    return out
