"""Change the scheduling policy while the engine serves: start with FCFS, switch to a policy
that favours the requests clients mark as important, and print the diff the engine logs.

    python examples/live_policy.py
"""

import anyio

from shunter import Engine, EngineConfig, PolicyError, SamplingParams, SchedulingParams

BY_PRIORITY = """
policy by_priority {
  priority = client_priority desc, arrival asc
  preempt recompute displace      # an important arrival may evict a less important request
}
"""


async def main() -> None:
    config = EngineConfig(num_blocks=24, max_num_seqs=8)  # small pool: requests compete
    async with Engine.start(config) as engine:
        async def client(i: int, priority: int) -> None:
            done = await engine.complete("def handler(request):\n", SamplingParams(max_tokens=48),
                                         scheduling=SchedulingParams(priority=priority))
            print(f"request {i} (priority {priority}): TTFT {done.timeline.ttft_s * 1000:.0f} ms")

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(client, i, 0)
            await anyio.sleep(0.2)
            new = await engine.replace_policy(BY_PRIORITY)
            print(f"now running {new.settings.name}")
            for i in range(12, 16):
                tg.start_soon(client, i, 5)
        try:
            await engine.replace_policy("policy broken { priority = slak asc }")
        except PolicyError as exc:
            print(f"refused, still running {engine.policy.settings.name}:\n{exc}")


if __name__ == "__main__":
    anyio.run(main)
