"""Shunter: an LLM serving engine built from actors, scheduled by policy files.

    import anyio
    import shunter

    async def main():
        async with shunter.Engine.start(shunter.EngineConfig()) as engine:
            async for chunk in engine.generate("def fib(n):", shunter.SamplingParams(max_tokens=32)):
                print(chunk.text, end="")

    anyio.run(main)

This package is the front door: everything a user imports is here. The floors below it are
`engine/` (types and mechanisms), `actors/`, `gpu/` and `sim/` (the backends) and `policy_lang/`.
Importing it loads no model and no torch; the torch backend loads them when an engine starts.
"""

from engine.config import EngineConfig
from engine.errors import (
    AdmissionError, ConfigError, EngineDeadError, InvalidRequestError, ModelLoadError, PolicyCheckError,
    PolicyError, PolicySyntaxError, PromptTooLongError, QueueFullError, RequestFailedError,
    RequestTooLongError, ShunterError, StreamClosedError,
)
from engine.outputs import GenerationChunk
from engine.params import SamplingParams, SchedulingParams
from engine.snapshots import EngineSnapshot
from engine.timeline import RequestTimeline
from shunter.client import Completion, GenerationStream
from shunter.engine import Engine
from shunter.remote import Client, ConnectionLostError, UnauthorizedError

__all__ = [
    "AdmissionError", "Client", "Completion", "ConfigError", "ConnectionLostError", "Engine",
    "EngineConfig", "EngineDeadError", "EngineSnapshot", "GenerationChunk", "GenerationStream", "InvalidRequestError",
    "ModelLoadError", "PolicyCheckError", "PolicyError", "PolicySyntaxError",
    "PromptTooLongError", "QueueFullError", "RequestFailedError", "RequestTimeline", "RequestTooLongError",
    "SamplingParams", "SchedulingParams", "ShunterError", "StreamClosedError", "UnauthorizedError",
]
