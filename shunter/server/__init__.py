"""`shunter serve`: an OpenAI-compatible HTTP server over one Engine (Starlette on Hypercorn)."""

from shunter.server.app import build_app
from shunter.server.settings import ServerSettings

__all__ = ["ServerSettings", "build_app"]
