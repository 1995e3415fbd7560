"""Policy evaluation cost per iteration: `decide()` on a frozen view of 100, 1,000 and 10,000
live requests, each compiled policy against a hand-written Python policy with the same rule.
The goal is a compiled policy within 2x of the hand-written one.

    python bench/policy_cost.py [--sizes 100 1000 10000] [--out bench/results/policy_cost.json]

Rules measured:
- fcfs: `policies/fcfs.policy` vs `engine.policy.FcfsPolicy`;
- priority: `policies/priority.policy` (client priority desc, arrival asc);
- precedence_slack: RT before BE, RT by slack, BE by checkpointed blocks then arrival;
- vtc: `policies/vtc.policy` (VTC counters with the returning-tenant lift);
- bros: `policies/bros.policy` packing (compiled only: its hand-written twin would be another
  implementation of Alg. 1, so it is reported for scale, not compared).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.cost_model import LLAMA3_8B_A100  # noqa: E402
from engine.policy import (  # noqa: E402
    Decision,
    FcfsPolicy,
    IterationOutcome,
    PolicySettings,
    RequestView,
    SchedulerView,
)
from policies import policy_dir, policy_path  # noqa: E402
from policy_lang import compile_policy, load_policy_file  # noqa: E402

PRECEDENCE_SLACK = """
policy precedence_slack {
  include "rtbe_classes.policy"
  precedence rt > be
  priority rt = slack asc
  priority be = checkpointed_blocks asc, arrival asc
}
"""


class HandPriority:
    def __init__(self) -> None:
        self.settings, self.source = PolicySettings(name="priority"), ""

    def decide(self, view: SchedulerView) -> Decision:
        order = sorted(view.requests, key=lambda r: (-r.priority, r.arrival))
        return Decision(order=order, displace=True)

    def observe(self, outcome: IterationOutcome) -> None:
        pass


class HandPrecedenceSlack:
    def __init__(self) -> None:
        self.settings, self.source = PolicySettings(name="precedence_slack"), ""

    def decide(self, view: SchedulerView) -> Decision:
        rt = [r for r in view.requests if r.request_class == "rt"]
        be = [r for r in view.requests if r.request_class != "rt"]
        now = view.now
        rt.sort(key=lambda r: r.slack_ms(now))
        be.sort(key=lambda r: (r.checkpointed_blocks, r.arrival))
        return Decision(order=rt + be)

    def observe(self, outcome: IterationOutcome) -> None:
        pass


class HandVtc:
    """VTC as the compiled vtc.policy does it, written out by hand."""

    def __init__(self) -> None:
        self.settings, self.source = PolicySettings(name="vtc"), ""
        self.service: dict[str, float] = {}
        self.active: set[str] = set()

    def decide(self, view: SchedulerView) -> Decision:
        tenants = {r.tenant for r in view.requests}
        if tenants != self.active:
            staying = [self.service.get(t, 0.0) for t in tenants & self.active]
            for t in tenants - self.active:
                self.service[t] = max(self.service.get(t, 0.0), min(staying)) if staying else \
                    self.service.get(t, 0.0)
            self.active = tenants
        service = self.service
        order = sorted(view.requests, key=lambda r: (service.get(r.tenant, 0.0), r.arrival))
        return Decision(order=order)

    def observe(self, outcome: IterationOutcome) -> None:
        for r, prompt, output in outcome.served:
            self.service[r.tenant] = self.service.get(r.tenant, 0.0) + prompt + 2 * output


def make_view(n: int, seed: int = 0) -> SchedulerView:
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        rt = rng.random() < 0.5
        state = rng.choice(("waiting", "running", "running", "swapped"))
        r = RequestView(
            id=i, request_class="rt" if rt else "be", priority=rng.randint(0, 3),
            tenant=f"t{rng.randrange(16)}", conversation_id=None, turn=1,
            arrival=rng.uniform(0, 100), prompt_tokens=rng.randint(16, 512), max_tokens=128,
            ttft_ms=400.0 if rt else None, tpot_ms=200.0 if rt else None, state=state,
            output_tokens=rng.randint(0, 64), checkpointed_blocks=rng.randint(0, 8))
        requests.append(r._replace(  # views are frozen: the derived fields go in a copy
            computed_tokens=r.context_tokens - 1 if state == "running" else 0,
            deadline=100.0 + rng.uniform(-50, 400) / 1000.0 if rt else float("inf")))
    return SchedulerView(now=100.0, iteration=1, requests=requests, free_blocks=1000,
                         total_blocks=4096, block_size=16, max_num_seqs=256,
                         max_batched_tokens=2048, cost=LLAMA3_8B_A100)


def per_call_us(policy, view: SchedulerView, budget_s: float = 0.4) -> float:
    timer = timeit.Timer(lambda: policy.decide(view))
    number, _ = timer.autorange()
    number = max(1, int(number * budget_s / 0.2))
    return min(timer.repeat(repeat=5, number=number)) / number * 1e6


def same_order(a, b, view: SchedulerView) -> bool:
    return [r.id for r in a.decide(view).order] == [r.id for r in b.decide(view).order]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--out", type=Path, default=Path("bench/results/policy_cost.json"))
    args = ap.parse_args()
    pairs = {
        "fcfs": (lambda: load_policy_file(policy_path("fcfs")), FcfsPolicy),
        "priority": (lambda: load_policy_file(policy_path("priority")), HandPriority),
        "precedence_slack": (lambda: compile_policy(PRECEDENCE_SLACK, base_dir=policy_dir()),
                             HandPrecedenceSlack),
        "vtc": (lambda: load_policy_file(policy_path("vtc")), HandVtc),
        "bros": (lambda: load_policy_file(policy_path("bros")), None),
    }
    rows = []
    print(f"{'rule':<18}{'requests':>9}{'compiled us':>13}{'hand us':>10}{'ratio':>7}")
    for name, (compiled_of, hand_of) in pairs.items():
        for n in args.sizes:
            view = make_view(n)
            compiled = compiled_of()
            row = {"rule": name, "requests": n, "compiled_us": per_call_us(compiled, view)}
            if hand_of is not None:
                hand = hand_of()
                assert same_order(compiled, hand, view), f"{name}: orders differ"
                row["hand_us"] = per_call_us(hand, view)
                row["ratio"] = row["compiled_us"] / row["hand_us"]
            rows.append(row)
            hand_us = f"{row['hand_us']:>10.1f}{row['ratio']:>7.2f}" if "ratio" in row else ""
            print(f"{name:<18}{n:>9}{row['compiled_us']:>13.1f}{hand_us}")
    result = {"benchmark": "policy decide() cost per iteration", "unit": "microseconds per call",
              "python": platform.python_version(), "machine": platform.machine(),
              "processor": platform.processor() or platform.machine(), "rows": rows,
              "worst_ratio": max(r["ratio"] for r in rows if "ratio" in r)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"worst compiled/hand ratio {result['worst_ratio']:.2f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
