"""Stream one completion from the shipped model, token by token (asyncio).

    python examples/stream.py "def fibonacci(n):"
"""

import sys

import anyio

from shunter import Engine, EngineConfig, SamplingParams


async def main(prompt: str) -> None:
    async with Engine.start(EngineConfig()) as engine:
        async for chunk in engine.generate(prompt, SamplingParams(max_tokens=60, temperature=0.7,
                                                                  top_p=0.9, seed=1)):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                t = chunk.timeline
                print(f"\n[{chunk.finish_reason}; first token after {t.ttft_s * 1000:.0f} ms]")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else "def fibonacci(n):")
