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

Either way every step runs, the restored KV equals a prefill and the outputs equal
transformers'.
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


@pytest.fixture(params=["kv@1", "vacate@1"])
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
    else:
        assert list(fallbacks) == ["1 weights"], restored
        assert "the test's fault" in member["prefetch"]["from_host"], member
        assert member["prefetch"]["vacated_blocks"] == 0 == member["prefetch"]["bytes"], member
        assert restored["kv_abandoned"] is None and restored["kv_bytes_at"] == partial, restored
        assert restored["weight_bytes_at"] == 0 < restored["weight_bytes_before"], \
            "the head's weights did not all come from the member while the group served"
    run_alone([(h0, s0)])
    _moved_back(reqs, moved)
    _check(model_dir, reqs)
