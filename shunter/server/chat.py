"""Chat templates: the model's own (tokenizer_config.json `chat_template`) or a file, rendered
with Jinja2 in a sandbox, since a template is code that came with a model download."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shunter.server.errors import ApiError, invalid


class ChatTemplateError(Exception):
    """A chat template file that cannot be read or compiled."""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, *, origin: str, bos_token: str = "",
                 eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            undefined=jinja2.ChainableUndefined)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{origin}:{exc.lineno}: {exc.message}") from None
        self.origin = origin
        self._special = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def from_file(cls, path: Path) -> ChatTemplate:
        try:
            return cls(path.read_text(), origin=str(path))
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"{path}: cannot read the chat template: {exc}") from None

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ChatTemplate | None:
        """The template in the model's tokenizer_config.json, or None if it has none."""
        path = model_dir / "tokenizer_config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        source = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(source, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        if not isinstance(source, str):
            return None
        return cls(source, origin=str(path), bos_token=_token(config, "bos_token"),
                   eos_token=_token(config, "eos_token"))

    def render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=True,
                                         **self._special)
        except jinja2.TemplateError as exc:
            raise invalid(f"the chat template refused the messages: {exc}", "messages") from None
        except Exception as exc:  # a template is code; whatever it raises is about the input
            raise invalid(f"the chat template failed on these messages: "
                          f"{type(exc).__name__}: {exc}", "messages") from None


def _token(config: dict, name: str) -> str:
    value = config.get(name)
    if isinstance(value, dict):  # {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """`messages` as role/content pairs; content given as text parts is joined."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string role", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, "unsupported", f"messages[{i}].content: only text parts "
                               "are supported", "messages")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string or a list of text parts",
                          "messages")
        out.append({"role": m["role"], "content": content})
    return out
