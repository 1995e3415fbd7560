"""The KunServe torch runner keeps nothing for a request between its release and its next setup
(gpu/kunserve_runner.py): a request that moved here, or that the engine recomputes after its
group lost a member, is set up again with its whole context (engine/step_plan.py). Before, the
runner kept each such request's tokens until its setup came, and a request cancelled before it
(released to be recomputed, never set up again) left its entry behind for good.

A real runner on a tiny model, no group processes: the loss is `lose_group` with a stand-in
group (the process-level path: tests/cluster/test_kunserve_torch_cluster.py)."""

from __future__ import annotations

import pytest

from engine.messages import BlockUpdate, ExecuteStep, RequestSetup, SeqWork
from engine.params import SamplingParams
from tests.reference import assert_matches, greedy_reference

PROMPT = (11, 52, 7, 300, 41, 9)
GREEDY = SamplingParams(max_tokens=8, temperature=0)


class LostGroup:
    """What `lose_group` reads of the group it loses."""

    ranks = (0, 1)

    def recover_from_host(self, rank: int) -> None:
        pass


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from gpu.make_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("kunserve-runner-2l"), arch="llama",
                              layers=2, hidden=64, heads=4, kv_heads=2, vocab=320, seed=3)


@pytest.fixture
def runner(model):
    from engine.config import EngineConfig
    from shunter.backends import build_backend

    runner = build_backend(EngineConfig(model=model, device="cpu", threads=1, num_blocks=24,
                                        block_size=4, cpu_swap_blocks=0)).runner
    runner._load()
    yield runner
    runner.close()


def _step(runner, n: int, *, release=(), setups=(), blocks=(), seqs=()) -> list[int]:
    done = runner.execute(ExecuteStep(step_id=n, release=tuple(release), setups=tuple(setups),
                                      blocks=tuple(blocks), seqs=tuple(seqs)))
    return [t.token_id for t in done.sampled]


def _setup(rid: int, tokens) -> RequestSetup:
    return RequestSetup(request_id=rid, prompt_ids=tuple(tokens), sampling=GREEDY,
                        eos_token_ids=())


def _blocks(runner, first: int, n: int) -> tuple[int, ...]:
    return tuple(runner._model.arena.kv_block_ids[first:first + n])


def _run_two_then_lose(runner, rid: int) -> list[int]:
    """Request `rid` prefills and decodes once (two tokens), then its group is lost and the
    engine releases it to recompute it (the `Regroup(recompute)` that follows a lost group)."""
    out = _step(runner, 1, setups=[_setup(rid, PROMPT)], blocks=[BlockUpdate(
        request_id=rid, reset=False, append=_blocks(runner, 0, 2))],
        seqs=[SeqWork(rid, 0, len(PROMPT), True)])
    out += _step(runner, 2, seqs=[SeqWork(rid, len(PROMPT), 1, True)])
    runner.group = LostGroup()
    from gpu.data_plane import GroupMemberLost

    runner.lose_group(GroupMemberLost(1, "a test step was sent", RuntimeError("reset")))
    _step(runner, 3, release=[rid])
    return out


def _holds(runner, rid: int) -> list[str]:
    """The runner's per-request tables that still name `rid`."""
    return [name for name, v in vars(runner).items()
            if isinstance(v, (dict, set)) and rid in v]


def test_a_recomputed_request_cancelled_before_its_setup_leaves_nothing(runner):
    _run_two_then_lose(runner, 5)
    _step(runner, 4)  # later steps: the engine ended it (cancelled) before setting it up again
    assert _holds(runner, 5) == []


def test_a_recomputed_request_set_up_with_its_whole_context_goes_on_as_greedy(runner, model):
    out = _run_two_then_lose(runner, 6)
    context = (*PROMPT, *out)  # what the engine's setup carries now
    out += _step(runner, 4, setups=[_setup(6, context)], blocks=[BlockUpdate(
        request_id=6, reset=False, append=_blocks(runner, 2, 3))], seqs=[SeqWork(6, 0, len(context), True)])
    out += _step(runner, 5, seqs=[SeqWork(6, len(context), 1, True)])
    assert_matches(out, greedy_reference(model, PROMPT, 4), "recomputed")
    _step(runner, 6, release=[6])
    assert _holds(runner, 6) == []
