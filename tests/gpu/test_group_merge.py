"""The KV transfers of a direct merge (gpu/group_messages.py `start_transfers` with
`Adopted.parts`): each merged member gets exactly the layers it keeps of a handed-over request
from the joining member that holds them, and nothing it holds already."""

from __future__ import annotations

from engine.cluster.plan import stage_layers
from engine.params import SamplingParams
from gpu.group_messages import Adopted, GroupStart, SeqState, start_transfers


def _start(adopted, seqs=(), held=()) -> GroupStart:
    return GroupStart(ranks=(5, 6, 7, 8), layers=stage_layers(8, 4), group=range(10, 50),
                      seqs=seqs, adopted=adopted, chunk_blocks=2, microbatches=8, held=held)


def test_a_handed_over_request_moves_each_layer_from_where_it_lies_once():
    parts = ((2, range(0, 4)), (3, range(4, 8)))  # the joining group (0-3 | 4-7)
    a = Adopted(request_id=7, owner=2, old_request_id=3, kv_tokens=10, parts=parts)
    got = {(t.src, t.dst, t.layers.start, t.layers.stop, t.blocks)
           for t in start_transfers(_start((a,)), block_size=4)}
    # member 0 keeps 0-1, 1 keeps 2-3 (both from 2), 2 keeps 4-5 (from 3); 3 holds 6-7 already
    assert got == {(2, 0, 0, 2, 3), (2, 1, 2, 4, 3), (3, 2, 4, 6, 3)}, got
    moved = sum(len(range(lo, hi)) for _, _, lo, hi, _ in got)
    assert moved == 6  # of 8 layers: each once at most


def test_the_staying_groups_requests_and_requests_of_one_owner_are_unchanged():
    whole = Adopted(request_id=8, owner=2, old_request_id=4, kv_tokens=5)  # an instance alone
    got = [(t.src, t.dst, t.layers) for t in start_transfers(_start((whole,)), block_size=4)]
    assert got == [(2, k, stage_layers(8, 4)[k]) for k in (0, 1, 3)], got
    seq = SeqState(request_id=1, tokens=(1, 2), table=(10, 11), sampling=SamplingParams())
    held = (range(0, 4), range(4, 8), range(0), range(0))  # the staying group (0-3 | 4-7)
    got = {(t.src, t.dst, t.layers.start, t.layers.stop)
           for t in start_transfers(_start((), (seq,), held), block_size=4)}
    assert got == {(0, 1, 2, 4), (1, 2, 4, 6), (1, 3, 6, 8)}, got


def test_a_handed_over_request_released_before_its_first_step_frees_its_kept_blocks():
    """A merged member reserved the blocks holding a handed-over request's kept KV (in place,
    gpu/kept_kv.py); the request ends before its table came: the blocks are free again."""
    from types import SimpleNamespace

    import numpy as np

    from gpu.block_map import BlockMap
    from gpu.group_merge import MergeStage

    view = SimpleNamespace(capacity=4, num_blocks=4, usable=np.arange(4, dtype=np.int64))
    stage = object.__new__(MergeStage)  # only what booking a step reads
    stage.map, stage.seqs, stage._owned_gens = BlockMap(view, range(4)), {}, {}
    stage.map.reserve(7, [1, 2])
    stage._book(SimpleNamespace(release=(7,), setups=(), blocks=(), moves=()))
    assert sorted(stage.map.assign(9, i, i) or stage.map.local(i) for i in range(4)) == [0, 1, 2, 3]
