"""`shunter generate --prompts-file`: one JSON object a line, a prompt and, optionally, its own
sampling and scheduling settings. Every error names the file and line (and column for JSON)."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import attrs

from engine.errors import InvalidRequestError
from engine.params import SchedulingParams

SAMPLING_KEYS = {"max_tokens": int, "temperature": float}
"""Per-line overrides of `--max-tokens` and `--temperature`."""
SCHEDULING_KEYS = {"priority": int, "request_class": str, "tenant": str, "conversation_id": str}
KEYS = ("prompt", "prompt_ids", *SAMPLING_KEYS, *SCHEDULING_KEYS)


@attrs.frozen(kw_only=True)
class PromptLine:
    prompt: str | list[int]
    where: str
    """`FILE:LINE`, or `--prompt` for the command line's prompt."""
    sampling: dict[str, Any] = attrs.field(factory=dict)
    """Overrides of the command line's sampling options (`max_tokens`, `temperature`)."""
    scheduling: SchedulingParams = SchedulingParams()


def prompt_from_option(text: str) -> PromptLine:
    if not text:
        raise InvalidRequestError('--prompt "": the prompt is empty')
    return PromptLine(prompt=text, where="--prompt")


def read_prompts(path: Path) -> list[PromptLine]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else f"not UTF-8 text ({exc.reason})"
        raise InvalidRequestError(f"--prompts-file {path}: cannot read it: {why}") from None
    prompts = [parse_line(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise InvalidRequestError(f"--prompts-file {path}: no prompts in it")
    return prompts


def parse_line(line: str, where: str) -> PromptLine:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{where}:{exc.colno}: not JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"{where}: expected a JSON object, got {json.dumps(obj)}")
    for key in obj:
        if key not in KEYS:
            near = difflib.get_close_matches(key, KEYS, n=1)
            hint = f'; did you mean "{near[0]}"?' if near else ""
            raise InvalidRequestError(f'{where}: unknown key "{key}"{hint} (keys: {", ".join(KEYS)})')
    obj = {k: v for k, v in obj.items() if v is not None}  # null: not given
    for key, kind in (SAMPLING_KEYS | SCHEDULING_KEYS).items():
        if key in obj and not _is(obj[key], kind):
            raise InvalidRequestError(f'{where}: "{key}" must be {_NAMES[kind]}, got '
                                      f"{json.dumps(obj[key])}")
    scheduling = {k: obj[k] for k in SCHEDULING_KEYS if k in obj}
    try:
        params = SchedulingParams(**scheduling)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{where}: {exc}") from None
    return PromptLine(prompt=_prompt(obj, where), where=where, scheduling=params,
                      sampling={k: obj[k] for k in SAMPLING_KEYS if k in obj})


def _prompt(obj: dict[str, Any], where: str) -> str | list[int]:
    if "prompt" in obj and "prompt_ids" in obj:
        raise InvalidRequestError(f'{where}: has both "prompt" and "prompt_ids"; give one')
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise InvalidRequestError(f'{where}: "prompt" must be a string, got '
                                      f'{json.dumps(obj["prompt"])}')
        if not obj["prompt"]:
            raise InvalidRequestError(f'{where}: "prompt" is empty')
        return obj["prompt"]
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(_is(t, int) for t in ids):
            raise InvalidRequestError(f'{where}: "prompt_ids" must be a list of token ids '
                                      f"(integers), got {json.dumps(ids)}")
        if not ids:
            raise InvalidRequestError(f'{where}: "prompt_ids" is empty')
        return ids
    raise InvalidRequestError(f'{where}: needs "prompt" (text) or "prompt_ids" (token ids)')


_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _is(value: object, kind: type) -> bool:
    if isinstance(value, bool):  # JSON true/false are not numbers here
        return False
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
