"""What a server is configured with, apart from its engine."""

from __future__ import annotations

from pathlib import Path

import attrs


@attrs.frozen(kw_only=True)
class ServerSettings:
    served_model_name: str | None = None
    """The model name clients send and `/v1/models` lists (default: the model directory's
    name, or `sim` on the sim backend)."""
    api_key: str | None = None
    """When set, every route but `/health` and `/version` needs `Authorization: Bearer KEY`."""
    chat_template: Path | None = None
    """A Jinja2 chat template file replacing the model's own (tokenizer_config.json)."""
    max_body_bytes: int = 1 << 20
    """Largest request body read; larger ones get 413 without being read to the end."""
    completion_max_tokens: int = 16
    """`max_tokens` of a completion that gives none (OpenAI's default)."""
    chat_max_tokens: int = 256
    """`max_tokens` of a chat completion that gives none."""
