"""The KV bytes a pipeline group's members moved between them, counted at its head (each byte
once, by the transfers the head planned or received; the bench JSON's
`cluster.kv_exchanged_bytes` is the sum over the heads: shunter/cluster/remote_groups.py).

- forming, growing, merging: every member's transfers of the exchange (`start_transfers`: the
  head plans them all, member-to-member ones included), counted when the head starts its own
  part; a member lost in the middle of the exchange leaves them counted as planned;
- restoring: what the head received (every restore transfer goes to the head).

Weights (a gained layer from a peer) are not KV and are not counted."""

from __future__ import annotations

from collections.abc import Sequence

from gpu.kv_exchange import KvTransfer


def transfer_bytes(transfers: Sequence[KvTransfer], model, block_size: int) -> int:
    """Bytes of `transfers` (each: `blocks` blocks of `len(layers)` layers, K and V)."""
    c = model.config
    per = 2 * block_size * c.num_kv_heads * c.head_dim * model.arena.buffer.element_size()
    return sum(t.blocks * len(t.layers) * per for t in transfers)


def count_moved(runner, n: int) -> None:
    """Add `n` bytes to the head runner's running count (`KunServeRunner.kv_moved_bytes`, never
    reset: the front door reads it as it goes, from when it joined)."""
    runner.kv_moved_bytes += n
