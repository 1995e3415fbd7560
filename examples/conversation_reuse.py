"""A multi-turn conversation under FastSwitch's policy: a small KV pool forces swaps, and each
turn swaps the history's KV in from host memory instead of prefilling it again (FastSwitch §3.3).

    python examples/conversation_reuse.py
"""

import anyio

from policies import policy_path
from shunter import Engine, EngineConfig, SamplingParams, SchedulingParams


async def main() -> None:
    config = EngineConfig(num_blocks=40, policy=policy_path("fastswitch_markov"),
                          record_iterations=True)
    async with Engine.start(config) as engine:
        history = "def parse(line):\n"
        for turn in range(4):
            done = await engine.complete(history, SamplingParams(max_tokens=24),
                                         scheduling=SchedulingParams(conversation_id="chat-1"))
            print(f"turn {turn + 1}: TTFT {done.timeline.ttft_s * 1000:.1f} ms, "
                  f"{len(done.token_ids)} tokens")
            history += done.text + "\n\ndef next_step(state):\n"
        swap = (await engine.take_iteration_log()).swap
        print(f"history blocks swapped in instead of prefilled: {swap.turn_prefix_blocks}; "
              f"copies {swap.copy_ops}, {swap.bytes_out} bytes out, {swap.bytes_in} bytes in")


if __name__ == "__main__":
    anyio.run(main)
