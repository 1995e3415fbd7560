"""KunServe adoption at a head whose group was not formed (engine/cluster/adoption.py): the
requests handed over come without their KV (it stayed with, or died with, their member), so
`Regroup(adopt=..., adopt_recompute=True)` has the scheduler's adoption prefill each again
from its whole context instead of waiting for an exchange that never comes. The process-level
paths: tests/cluster/test_kunserve_torch_faults.py."""

from __future__ import annotations

import attrs
import pytest

from engine.cluster.adoption import AdoptionMixin, GroupSeat
from engine.messages import Regroup
from engine.params import SamplingParams
from engine.reply import Reply
from engine.request import Request


class Seat(AdoptionMixin):
    """The scheduler's state that the adoption mechanism reads and changes."""

    def __init__(self) -> None:
        self._live, self._release, self._in_flight = {}, [], {}
        self._total_blocks, self._seat = 24, GroupSeat()
        self._config = attrs.make_class("C", {"block_size": attrs.field(default=4)})()


def _request(rid: int, state: str, computed: int, *, blocks=0, swapped=0) -> Request:
    return Request(id=rid, request_class="default", priority=0, tenant="default",
                   conversation_id=None, turn=1, arrival=0.0, ttft_ms=None, tpot_ms=None,
                   prompt_ids=[5] * 6, sampling=SamplingParams(max_tokens=16),
                   stop_ids=frozenset(), eos_token_ids=(), state=state, computed_tokens=computed,
                   blocks=blocks, swapped_blocks=swapped, output_ids=[7, 8, 9])


def _handed_over() -> tuple[Request, ...]:
    """As a member exported them: one running (8 tokens of KV on its device), one swapped to
    its host, one queued with no KV."""
    return (_request(1, "running", 8, blocks=2), _request(2, "swapped", 8, swapped=2),
            _request(3, "waiting", 0))


@pytest.mark.anyio
async def test_adopted_to_recompute_wait_for_a_prefill_not_for_their_kv(anyio_backend):
    seat, reply = Seat(), Reply()
    reqs = _handed_over()
    seat._regroup(Regroup(adopt=reqs, adopt_recompute=True, reply=reply))
    assert await reply.wait() == ()  # none waits for an exchange
    assert set(seat._live) == {1, 2, 3} and seat._seat.adopted == 3
    for q in reqs:
        assert (q.state, q.computed_tokens, q.blocks, q.swapped_blocks) == ("waiting", 0, 0, 0)
        assert q.output_ids == [7, 8, 9] and not q.known_to_executor, q
    assert [q.preemptions for q in reqs] == [1, 1, 0]  # the queued one lost nothing


@pytest.mark.anyio
async def test_adopted_for_a_formed_group_wait_for_their_kv(anyio_backend):
    """The same requests adopted by a group that formed: the one with KV on its device waits
    for its exchange holding its blocks, the swapped one keeps its host copy."""
    seat, reply = Seat(), Reply()
    reqs = _handed_over()
    seat._regroup(Regroup(adopt=reqs, reply=reply))
    assert [q.id for q in await reply.wait()] == [1]
    assert [(q.state, q.computed_tokens, q.blocks) for q in reqs] == [
        ("swapping_in", 8, 2), ("swapped", 8, 0), ("waiting", 0, 0)]
    assert reqs[1].swapped_blocks == 2 and [q.preemptions for q in reqs] == [0, 0, 0]


@pytest.mark.anyio
async def test_their_setups_carry_their_whole_context(anyio_backend):
    """The executor has not seen them: their setups carry prompt and output so far (the torch
    runner keeps no copy of a request's tokens between its release and its setup)."""
    from engine.step_plan import _setups

    seat, reqs = Seat(), _handed_over()
    fresh = _request(4, "waiting", 0)
    fresh.output_ids = []
    seat._regroup(Regroup(adopt=(*reqs, fresh), adopt_recompute=True, reply=Reply()))
    plan = attrs.make_class("Plan", ["swapped_in", "work"])((), {1: 9, 3: 9, 4: 6})
    setups = _setups(plan, seat._live)
    assert [(s.request_id, tuple(s.prompt_ids)) for s in setups] == [
        (1, (5,) * 6 + (7, 8, 9)), (3, (5,) * 6 + (7, 8, 9)), (4, (5,) * 6)]
