"""Workload spec strings, `NAME[:key=value,...]`, or a TOML file saying the same:

    name = "azure-conv"
    rate = "2x"
    duration = 600

Every name and key is documented here, once; `shunter bench --help` and bench/README.md print
these tables.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from engine.errors import ShunterError

WORKLOADS: dict[str, str] = {
    "azure-conv": "Azure LLM inference trace 2023, conversation service (19,366 requests, 1 h)",
    "azure-code": "Azure LLM inference trace 2023, code service (8,819 requests, 1 h, very bursty)",
    "mooncake-conv": "Mooncake FAST'25 conversation trace (12,031 requests, 1 h, ~12k-token "
                     "prompts); shared hash_ids prefixes become shared prompt prefixes and later "
                     "turns of one conversation",
    "mooncake-synth": "Mooncake FAST'25 synthetic trace (3,993 requests, Poisson arrivals, heavy "
                      "prefix sharing)",
    "sharegpt": "ShareGPT request lengths with synthetic arrivals (Poisson, or Gamma with cv)",
    "arxiv": "arXiv summarization lengths with synthetic arrivals (long prompts, short outputs)",
    "multiturn": "SYNTHETIC multi-turn conversations: turns, think times and per-turn lengths "
                 "drawn (seeded) from the ShareGPT length table; each turn's prompt is the whole "
                 "conversation so far",
    "sharegpt-bros": "ShareGPT lengths filtered to BROS Table 2's means (prompt <= 612, output "
                     "<= 500: mean 222.7/233.7 tokens) with synthetic arrivals",
    "lmsys-bros": "SYNTHETIC lengths: a log-normal fitted to BROS Table 2's LMSYS-Chat-1M row "
                  "(mean prompt 90.5, output 237.0) with synthetic arrivals",
    "be-batch": "BROS best-effort batches only: prompts uniform 512-1024, outputs uniform "
                "32-128, a new batch when the last completes",
    "rtbe": "an RT workload (key rt, default sharegpt-bros with Poisson arrivals, as BROS §7.1) "
            "mixed with BROS best-effort batches",
}

TRACES = ("azure-conv", "azure-code", "mooncake-conv", "mooncake-synth")
TABLES = ("sharegpt", "arxiv")
BROS_TABLES = ("sharegpt-bros", "lmsys-bros")

KEYS: dict[str, str] = {
    "rate": "traces: a multiplier `2x` (replay twice as fast) or a mean rate in requests/s; "
            "synthetic: requests/s (multiturn: conversations/s)",
    "start": "seconds of the trace to skip before the window (default 0)",
    "duration": "seconds of the trace to replay (default: all); synthetic and BE batches: "
                "seconds of arrivals",
    "requests": "most open-loop requests (traces: the first N of the window; synthetic default "
                "200)",
    "seed": "seeds every random choice (default: bench --seed, else 0)",
    "tenants": "spread requests (whole conversations) over N tenants t0..tN-1 (default 1)",
    "scale_lengths": "multiply every prompt and output length (e.g. 0.05 for a tiny model)",
    "max_input": "cap prompt lengths (tokens)",
    "max_output": "cap output lengths (tokens)",
    "ttft_ms": "TTFT SLO of RT requests (default 400, BROS §7.1; 0: none)",
    "tpot_ms": "TPOT SLO of RT requests (default 200, BROS §7.1; 0: none)",
    "arrival": "synthetic arrivals: poisson (default) or gamma",
    "cv": "gamma arrivals: coefficient of variation of the gaps (default 2; 1 is Poisson)",
    "conversations": "multiturn: number of conversations (default 50)",
    "turns": "multiturn: mean turns per conversation (default 5.5, as in ShareGPT multi-round)",
    "think": "multiturn: mean think time between an answer and the next turn, s (default 5)",
    "max_len": "multiturn: end a conversation before its context passes this (default 8192)",
    "table": "multiturn: length table, sharegpt (default) or arxiv",
    "batch_size": "be-batch/rtbe: requests per BE batch (default 32)",
    "batches": "be-batch: number of BE batches (default 10); rtbe: at most this many",
    "be_prompt": "BE prompt length range lo-hi (default 512-1024)",
    "be_output": "BE output length range lo-hi (default 32-128)",
    "rt": "rtbe: the RT workload name (default sharegpt-bros); its keys apply to it",
    "priority": "client priorities, for policies that rank by client_priority (e.g. "
                "policies/priority.policy): none (default), random (uniform in 0..levels-1 per "
                "request) or markov (a turn keeps its predecessor's priority with probability "
                "0.8). The FastSwitch policy files update priorities themselves (`every N "
                "iterations: rerank ...`)",
    "levels": "priority levels for `priority` (default 4)",
}


class WorkloadSpecError(ShunterError):
    """A workload spec names an unknown workload or key, or a value that does not parse."""


def parse_spec(text: str) -> tuple[str, dict[str, str]]:
    """`NAME[:key=value,...]`, or a path to a TOML file -> (name, raw keys)."""
    if text.endswith(".toml"):
        return _read_toml(Path(text))
    name, _, rest = text.partition(":")
    name = name.strip()
    keys: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise WorkloadSpecError(f"workload spec {text!r}: {item!r} is not key=value")
        keys[key.strip()] = value.strip()
    check(name, keys, text)
    return name, keys


def _read_toml(path: Path) -> tuple[str, dict[str, str]]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise WorkloadSpecError(f"{path}: cannot read workload file: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadSpecError(f"{path}: not TOML: {exc}") from None
    name = data.pop("name", None)
    if not isinstance(name, str):
        raise WorkloadSpecError(f'{path}: needs name = "<workload>" (one of {", ".join(WORKLOADS)})')
    keys = {k: str(v) for k, v in data.items()}
    check(name, keys, str(path))
    return name, keys


def check(name: str, keys: dict[str, str], where: str) -> None:
    if name not in WORKLOADS:
        raise WorkloadSpecError(f"{where}: unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    for k in keys:
        if k not in KEYS:
            raise WorkloadSpecError(f"{where}: unknown key {k!r}; known: {', '.join(KEYS)}")


class Keys:
    """Typed access to a spec's keys; every read value is recorded for the report."""

    def __init__(self, raw: dict[str, str], where: str) -> None:
        self.raw, self.where = raw, where
        self.used: dict[str, Any] = {}

    def _get(self, key: str, default: Any, conv: Any) -> Any:
        if key not in self.raw:
            self.used.setdefault(key, default)
            return default
        try:
            value = conv(self.raw[key])
        except ValueError:
            raise WorkloadSpecError(
                f"{self.where}: {key}={self.raw[key]!r} is not a valid {conv.__name__}") from None
        self.used[key] = value
        return value

    def number(self, key: str, default: float | None) -> float | None:
        return self._get(key, default, float)

    def integer(self, key: str, default: int | None) -> int | None:
        return self._get(key, default, int)

    def text(self, key: str, default: str | None) -> str | None:
        return self._get(key, default, str)

    def span(self, key: str, default: tuple[int, int]) -> tuple[int, int]:
        def int_range(v: str) -> tuple[int, int]:
            lo, _, hi = v.partition("-")
            a, b = int(lo), int(hi or lo)
            if not 0 < a <= b:
                raise ValueError(v)
            return a, b
        int_range.__name__ = "range lo-hi"
        return self._get(key, default, int_range)

    def rate(self) -> tuple[float | None, float | None]:
        """(multiplier, requests/s): `2x` -> (2, None); `5` -> (None, 5)."""
        raw = self.raw.get("rate")
        if raw is None:
            self.used.setdefault("rate", None)
            return None, None
        try:
            value = float(raw[:-1] if raw.endswith("x") else raw)
            if value <= 0:
                raise ValueError(raw)
        except ValueError:
            raise WorkloadSpecError(
                f"{self.where}: rate={raw!r} is neither a multiplier like 2x nor requests/s") from None
        self.used["rate"] = raw
        return (value, None) if raw.endswith("x") else (None, value)


def help_text() -> str:
    """The names and keys, formatted for `--help` and the README."""
    lines = ["workloads (NAME[:key=value,...] or a TOML file with name = ... and keys):"]
    lines += [f"  {n:15s} {d}" for n, d in WORKLOADS.items()]
    lines.append("keys:")
    lines += [f"  {k:15s} {d}" for k, d in KEYS.items()]
    return "\n".join(lines)
