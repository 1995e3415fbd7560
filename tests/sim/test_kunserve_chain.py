"""A KunServe group's step (sim/group.py) when a long prefill is cut across microbatches and
the chain bound is on (`GroupNetwork.chain`, the bench's --chain): its last piece enters stage 0
only after the earlier microbatches have left it, so a step whose cut prompt samples lasts at
least stage 0's time for the earlier pieces plus the last piece's trip; steps of whole
sequences, and cut prompts that sample later, keep the steady-state period."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from engine.cluster.drop_plan import GroupPlan
from engine.cluster.plan import stage_layers
from engine.cost_model import BatchShape
from engine.messages import ExecuteStep, SeqWork
from sim.group import GroupNetwork, SimGroup
from sim.network import NetworkLink
from sim.profile import load_profile

LINK = NetworkLink(name="t", latency_s=0.0, bytes_per_s=1e12)  # activations ~free


def _step(seqs: list[tuple[int, int]], *, sample: bool = True, chain: bool = True):
    """One group step of 2 stages over `seqs` (request's context so far, tokens now) on the A10
    profile, by token count; returns (step time, the net)."""
    prof = load_profile("llama3-8b-a10")
    net = GroupNetwork(link=LINK, model=prof.model, chain=chain)
    plan = GroupPlan(group_id=0, members=(0, 1), layers=stage_layers(prof.model.num_layers, 2))
    group = SimGroup(plan, prof.cost, net, token_id=7)
    step = ExecuteStep(step_id=1, release=(), setups=(), blocks=(), seqs=tuple(
        SeqWork(request_id=i, start=s, num_tokens=n, sample=sample) for i, (s, n) in enumerate(seqs)))

    async def run():
        return (await group.step(step)).compute_s

    return trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0)), net, prof.cost


def test_a_prompt_cut_in_two_waits_for_its_first_piece_to_clear_stage_0():
    took, net, cost = _step([(0, 4096)])  # one request: 2048 tokens in each microbatch
    first = cost.predict_ms(BatchShape.of([(0, 2048)])) / 1e3
    second = cost.predict_ms(BatchShape.of([(2048, 2048)])) / 1e3
    # stage 0 runs the first piece (half its cost), then the second piece makes its whole trip
    assert took == pytest.approx(0.5 * first + second, rel=1e-3)
    assert took > 1.2 * max(first, second)  # the steady-state period alone was max(pieces)
    assert net.chain_steps == 1
    kind, net, _ = _step([(0, 4096)], chain=False)  # the steady-state model (the default)
    assert kind == pytest.approx(max(first, second), rel=1e-3) and net.chain_steps == 0


def test_a_piece_with_no_token_after_it_keeps_the_period():
    took, net, cost = _step([(0, 4096)], sample=False)  # the prompt goes on next step
    second = cost.predict_ms(BatchShape.of([(2048, 2048)])) / 1e3
    assert took == pytest.approx(second, rel=1e-3)
    assert net.chain_steps == 0


def test_whole_sequences_keep_the_steady_state_period():
    took, net, cost = _step([(0, 2048), (0, 2048)])  # two requests, one per microbatch
    one = cost.predict_ms(BatchShape.of([(0, 2048)])) / 1e3
    assert took == pytest.approx(one, rel=1e-3)
    assert net.chain_steps == 0
