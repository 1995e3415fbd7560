"""A member's kept KV across a re-split (gpu/kept_kv.py): the KV of the layers it keeps of those
it held stays where it lies, read through the new stage view (the same memory: no copy), when
the new view has a usable block over it; the other blocks (the new stride does not divide the
old block's place, gained weights over it, a block shared by two requests) are copied into
fresh blocks. Both are read back equal, the counts say which was which, and a re-split group's
stages compute what the full model does."""

from __future__ import annotations

import pytest
import torch

import gpu.kept_kv as kept_kv
from gpu.block_map import BlockMap
from gpu.kept_kv import KeptKV
from gpu.make_model import write_random_model
from gpu.metadata import build_step_inputs
from gpu.model import CausalLM
from gpu.stage_view import drop_layers, redrop_layers


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {n: write_random_model(tmp_path_factory.mktemp(f"tiny-{n}l"), arch="llama",
                                  layers=n, hidden=64, heads=4, kv_heads=2, vocab=320, seed=7)
            for n in (6, 8)}


def _resplit(model, keep: range, entries: list[int], rid: int = 1
             ) -> tuple[KeptKV, BlockMap, list[int]]:
    """`model` (dropped) keeps `keep` now; `entries` (old stage blocks, in table order) are a
    request's KV: reserved in place or copied as a merged member does. Returns the new
    stage block of each entry."""
    kept = KeptKV(model, keep, entries)
    redrop_layers(model, keep)
    view = model.drop_state.view
    bm = BlockMap(view, range(1000, 1000 + min(view.capacity, 64)))
    if len(kept.stay):  # (nothing kept: the KV of every layer it keeps comes from others)
        bm.reserve(rid, [kept.place(b) for b in entries])
        for i, j in bm.fresh(rid):
            kept.write_copy(model, entries[i], j)
    kept.done()
    for i in range(len(entries)):
        assert bm.assign(rid, i, 1000 + i) is None
    bm.done_reserving(rid)
    return kept, bm, bm.locals([1000 + i for i in range(len(entries))])


@pytest.mark.parametrize("layers, was, keep, copies", [
    (8, range(4), range(2), "shared"),  # strides 4 -> 2: every block in place
    (8, range(4, 8), range(7, 8), "shared"),  # 4 -> 1 (a merge's joining last stage)
    (8, range(4, 8), range(6, 7), "shared"),
    (6, range(3), range(2), "some"),  # 3 -> 2: a block at an odd place lies across two
    (6, range(3, 6), range(2, 4), "some"),  # gains layer 2: its weights come back too
    (8, range(4), range(6, 7), "none kept"),
])
def test_kept_kv_stays_where_it_lies_where_the_layout_allows(model_dirs, layers, was, keep,
                                                             copies, monkeypatch):
    copied = {}
    for in_place in (True, False):  # the same requests, with and without the in-place path
        monkeypatch.setattr(kept_kv, "IN_PLACE", in_place)
        model = CausalLM.from_pretrained(model_dirs[layers], num_kv_blocks=12, block_size=4)
        drop_layers(model, was)
        old = model.drop_state.view
        usable = [int(b) for b in old.usable]
        torch.manual_seed(0)
        for k, v in model._kv:
            k[usable] = torch.randn_like(k[usable])
            v[usable] = torch.randn_like(v[usable])
        entries = usable[:14] + usable[3:5]  # the last two: blocks shared with earlier entries
        stay = [layer for layer in keep if layer in was]
        want = {(b, layer): (model._kv[layer - was.start][0][b].clone(),
                             model._kv[layer - was.start][1][b].clone())
                for b in entries for layer in stay}
        where = {b: model._kv[stay[0] - was.start][0][b].data_ptr() for b in entries if stay}
        kept, _, new = _resplit(model, keep, entries)
        for i, (b, j) in enumerate(zip(entries, new, strict=True)):
            for layer in stay:
                k, v = model._kv[layer - keep.start]
                assert torch.equal(k[j], want[b, layer][0]), (i, b, j, layer)
                assert torch.equal(v[j], want[b, layer][1]), (i, b, j, layer)
            if stay and b in kept.in_place and i < 14:  # the same memory: not copied
                assert model._kv[stay[0] - keep.start][0][j].data_ptr() == where[b], (i, b, j)
        assert kept.in_place_bytes + kept.copied_bytes == len(entries) * kept.block_bytes
        copied[in_place] = kept.copied_bytes
        if not in_place or copies == "none kept":
            assert kept.in_place_bytes == 0
            assert kept.copied_bytes == (len(entries) * kept.block_bytes if stay else 0)
        elif copies == "shared":  # only the two second uses of a shared block are copied
            assert kept.copied_bytes == 2 * kept.block_bytes, (kept.copied_bytes,
                                                               kept.block_bytes)
        else:
            assert 0 < kept.copied_bytes < kept.in_place_bytes + kept.copied_bytes
    print(f"\nkept KV, {layers} layers {was.start}-{was.stop - 1} -> {keep.start}-{keep.stop - 1}"
          f", {len(entries)} blocks: copied {copied[False]} B before, {copied[True]} B now")


def _decode_logits(stages, tables, token: int, pos: int) -> torch.Tensor:
    h = None
    for stage, table in zip(stages, tables, strict=True):
        step = build_step_inputs([([token], pos, table)], 4, "cpu", sample=[True])
        h = stage.forward_stage(step.input_ids if h is None else h, step.positions, step.meta,
                                step.logits_indices)
    return h


@pytest.mark.parametrize("layers", [6, 8])
def test_a_resplit_group_computes_what_the_full_model_does(model_dirs, layers):
    """Two stages (halves) prefill; then they re-split into three stages (a third copy joins
    with the last layers) the way a growing group does: each old stage keeps its kept layers'
    KV in place where it can, the layers a stage gains get their KV by hand from the one that
    held them; a decode through the three stages gives the full model's logits."""
    full, a, b, c = (CausalLM.from_pretrained(model_dirs[layers], num_kv_blocks=12,
                                              block_size=4) for _ in range(4))
    half = layers // 2
    cut = {6: (range(2), range(2, 4), range(4, 6)), 8: (range(3), range(3, 6), range(6, 8))}
    ka, kb, kc = cut[layers]
    W = full.arena.weight_blocks
    tokens = list(range(40, 49))
    pre = build_step_inputs([(tokens, 0, [W, W + 1, W + 2])], 4, "cpu", sample=[True])
    want = full.forward_stage(pre.input_ids, pre.positions, pre.meta, pre.logits_indices)
    nxt = int(want.argmax())
    want2 = _decode_logits([full], [[W, W + 1, W + 2]], nxt, 9)
    drop_layers(a, range(half))
    drop_layers(b, range(half, layers))
    drop_layers(c, kc)
    ta = [int(x) for x in a.drop_state.view.usable[1:4]]  # blocks at odd and even places
    tb = [int(x) for x in b.drop_state.view.usable[1:4]]
    h = None
    for stage, table in ((a, ta), (b, tb)):
        step = build_step_inputs([(tokens, 0, table)], 4, "cpu", sample=[True])
        h = stage.forward_stage(step.input_ids if h is None else h, step.positions, step.meta,
                                step.logits_indices)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)

    def read(stage, table, layer_range):  # the layers' KV of `table`, [blocks, layers, 2, ...]
        first = stage.drop_state.keep.start
        idx = torch.tensor(table)
        return torch.stack([torch.stack((stage._kv[i - first][0][idx],
                                         stage._kv[i - first][1][idx]), dim=1)
                            for i in layer_range], dim=1)

    def write(stage, table, layer_range, data):
        first = stage.drop_state.keep.start
        for j, i in enumerate(layer_range):
            stage._kv[i - first][0][torch.tensor(table)] = data[:, j, 0]
            stage._kv[i - first][1][torch.tensor(table)] = data[:, j, 1]

    # what another stage keeps now, sent before the re-split overwrites it: b gains the
    # layers of a's half it keeps now, c takes its layers from b; a only keeps
    gained = range(kb.start, half)
    to_b, to_c = read(a, ta, gained), read(b, tb, kc)
    kept_a, _, na = _resplit(a, ka, ta)
    kept_b, _, nb = _resplit(b, kb, tb, rid=2)
    nc = [int(x) for x in c.drop_state.view.usable[:3]]
    write(b, nb, gained, to_b)
    write(c, nc, kc, to_c)
    got2 = _decode_logits([a, b, c], [na, nb, nc], nxt, 9)
    torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-5)
    assert kept_a.in_place_bytes > 0 and kept_b.in_place_bytes > 0, (kept_a, kept_b)
    if layers == 8:  # strides 4 -> 4: a's blocks all in place (b's: those under no gained
        assert kept_a.copied_bytes == 0  # weights of layer 3)
    else:  # strides 3 -> 2: of blocks 1-3 of its view, those at an odd place are copied
        assert kept_a.copied_bytes > 0


@pytest.mark.parametrize("was, keep", [(range(3), range(2)), (range(3, 6), range(4, 6))])
def test_blocks_a_member_hands_out_first_stay_in_place_at_its_next_resplit(model_dirs, was,
                                                                          keep):
    """A block map hands out first the blocks whose KV any smaller stride can keep in place
    (`StageView.resplit_first`): with 6 layers (stride 3, then 2) the KV of the first blocks a
    member maps is kept where it lies when it keeps fewer layers of its range."""
    model = CausalLM.from_pretrained(model_dirs[6], num_kv_blocks=12, block_size=4)
    drop_layers(model, was)
    bm = BlockMap(model.drop_state.view, range(100))
    for i in range(40):
        bm.assign(1, i, i)
    kept = KeptKV(model, keep, bm.locals(range(40)))
    assert len(kept.in_place) == 40, kept.in_place
