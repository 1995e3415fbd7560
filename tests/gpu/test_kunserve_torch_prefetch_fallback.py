"""KunServe on the torch backend: a member whose part of a restore prefetch cannot start (an
error, not a loss) falls back to the restore's step while the group serves on
(gpu/group_member.py `start_prefetch`). Two instance processes of the tiny 4-layer Llama,
driven as tests/gpu/test_kunserve_torch_prefetch.py drives them.

- `kv@1`: its first KV round cannot be gathered. It sends that round and every later one as
  zeros (the head posted their receives: the chunks' numbers stay the head's), its answers say
  so, and the head names no more rounds and uses none (`KvPrefetch.abandon`): every block's KV
  moves at the restore's step. Before (session 31): the member never sent round 0, every later
  step failed on it ("its restore prefetch could not start": each step's requests failed), the
  prefetch never became ready and the restore waited 30 s for a round that never came.
- `vacate@1`: it cannot vacate its dropped layers' memory. It keeps its KV where it is, still
  sends its kept layers (the head's prefetch goes on), takes the head's into scratch, and writes
  its own from its host copy at the restore's step (`WeightPrefetch.from_host`). Before: every
  step failed on it, and the head, waiting for its weights, named it lost after 60 s.

- `fill@0` / `fill@1`: a prefetching thread of the head / the member fails on its first chunk:
  that one falls back to its host copy at the step the same way (the peer's chunks still due
  taken into scratch). Before: the error was raised by every later step ('prefetching the
  dropped layers failed: OSError: ...'), so every step failed, and so did `ready`.

Either way every step runs, the restored KV equals a prefill and the outputs equal
transformers'. A vacating that breaks part-way (`copy@1`) ends the group as a loss does.
"""

from __future__ import annotations

import pytest

from gpu.restore_prefetch import PREFETCH_FAULT_ENV
from tests.gpu.kunserve_driver import hosts_with_env, restored_kv_is_a_prefill, run_alone
from tests.gpu.test_kunserve_torch_prefetch import (  # noqa: F401 (model_dir: a fixture)
    BLOCK,
    SOLO_BLOCKS,
    _check,
    _full_block_bytes,
    _grouped,
    _partial_block_bytes,
    _restore,
    _serve_until_ready,
    _shrink,
    model_dir,
)
from tests.gpu.test_kunserve_torch_prefetch_faults import _moved_back


@pytest.fixture(params=["kv@1", "vacate@1", "fill@0", "fill@1"])
def hosts_prefetch_fails(model_dir, request):
    for started in hosts_with_env(model_dir, SOLO_BLOCKS, BLOCK, 2, PREFETCH_FAULT_ENV,
                                  request.param):
        yield (*started, request.param)


def test_a_member_whose_prefetch_cannot_start_falls_back_to_the_restores_step(
        model_dir, hosts_prefetch_fails):
    (h0, h1), (solo0, solo1), fault = hosts_prefetch_fails
    s0, reqs, moved = _grouped(model_dir, h0, h1, solo0, solo1, seed=6)
    _shrink(h0, s0, solo0)
    h0.call("prefetch", "peer")
    _serve_until_ready(h0, s0, worked=BLOCK + 1)  # (every step ran: a failed one raises)
    partial, full = _partial_block_bytes(model_dir, s0), _full_block_bytes(model_dir, s0)
    restored, member = _restore(h0, h1, s0, solo0)
    restored_kv_is_a_prefill(h0, h1, s0, solo1)
    fallbacks = restored["prefetch_fallbacks"]
    if fault == "kv@1":
        assert list(fallbacks) == ["1 kv"] and "the test's fault" in fallbacks["1 kv"], restored
        assert "instance 1" in restored["kv_abandoned"], restored
        assert restored["kv_bytes_at"] == partial + full, \
            f"the restore's step moved {restored['kv_bytes_at']:.0f} B, every live block's " \
            f"KV is {partial + full} B: prefetched rounds of zeros were used"
        assert restored["weight_bytes_at"] == 0 < restored["weight_bytes_before"], restored
    elif fault == "fill@0":  # the head's own weights from its host copy at the step
        assert not fallbacks and "the test's fault" in restored["from_host"], restored
        assert restored["weight_bytes_at"] > 0 == restored["weight_bytes_before"], restored
        assert restored["kv_abandoned"] is None and restored["kv_bytes_at"] == partial, restored
        assert member["prefetch"]["from_host"] is None, member  # (its own all came)
    else:
        assert list(fallbacks) == ["1 weights"], restored
        assert "the test's fault" in member["prefetch"]["from_host"], member
        if fault == "vacate@1":
            assert member["prefetch"]["vacated_blocks"] == 0 == member["prefetch"]["bytes"]
        assert restored["kv_abandoned"] is None and restored["kv_bytes_at"] == partial, restored
        assert restored["weight_bytes_at"] == 0 < restored["weight_bytes_before"], \
            "the head's weights did not all come from the member while the group served"
    run_alone([(h0, s0)])
    _moved_back(reqs, moved)
    _check(model_dir, reqs)


@pytest.fixture
def hosts_vacate_breaks(model_dir):
    yield from hosts_with_env(model_dir, SOLO_BLOCKS, BLOCK, 2, PREFETCH_FAULT_ENV, "copy@1")


def test_a_member_whose_vacating_breaks_part_way_ends_the_group_as_a_loss(
        model_dir, hosts_vacate_breaks):
    """Its vacating copies fail after one (a device error: its map moved blocks whose KV did
    not): neither the group nor its restore can go on, so the next step ends the group as a
    member lost does (`PrefetchBroken`, rank -1: every member told), and every request is
    recomputed. Before: every later step failed on it ('its restore prefetch could not
    start'), and so did every restore."""
    (h0, h1), (solo0, solo1) = hosts_vacate_breaks
    s0, reqs, moved = _grouped(model_dir, h0, h1, solo0, solo1, seed=6)
    _shrink(h0, s0, solo0)
    h0.call("prefetch", "peer")
    step = s0.next_step()
    h0.conn.send(("step", step))
    kind, message = h0.conn.recv()
    assert kind == "lost" and "restore prefetch broke: instance 1: " in message, (kind, message)
    assert "the test's fault: a vacating copy failed part-way" in message, message
    assert "restore prefetch broke" in h1.answer()["abandoned"]
    rids = h0.call("recover", -1)  # every request the group held: recomputed (the head ran
    assert sorted(rids) == sorted(r.rid for r in s0.live())  # the step: its releases went)
    s0.release, s0.free = [], list(reversed(solo0))
    for r in s0.live():
        r.table, r.computed, r.reset, r.ready = [], 0, True, True
    run_alone([(h0, s0)])
    _moved_back(reqs, moved)
    _check(model_dir, reqs)
