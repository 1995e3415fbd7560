"""Many clients at once under trio: 16 requests share the engine's batches, one is cancelled
half-way (its KV blocks go back at once), and the engine ends idle with no block allocated.

    python examples/concurrent_trio.py
"""

import trio

from shunter import Engine, EngineConfig, SamplingParams

PROMPTS = ["import os\n", "class Parser:\n", "def main():\n", "for line in f:\n"] * 4


async def main() -> None:
    async with Engine.start(EngineConfig(max_num_seqs=16)) as engine:
        results: dict[int, str] = {}

        async def client(i: int) -> None:
            done = await engine.complete(PROMPTS[i], SamplingParams(max_tokens=32, seed=i,
                                                                    temperature=0.8))
            results[i] = done.text

        async def impatient() -> None:
            with trio.move_on_after(0.05):  # gives up: the request is cancelled
                async for chunk in engine.generate("def slow():\n", SamplingParams(max_tokens=500)):
                    pass

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(client, i)
            nursery.start_soon(impatient)
        snapshot = await engine.wait_idle()
    for i in sorted(results):
        print(f"--- {i}: {PROMPTS[i]!r}\n{results[i]}")
    print(f"idle: {snapshot.allocator.allocated_blocks} KV blocks allocated, "
          f"{snapshot.scheduler.preemptions} preemptions")


if __name__ == "__main__":
    trio.run(main)
