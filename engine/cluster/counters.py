"""What a cluster's KunServe group manager counts: the bench JSON's `cluster` block. One type
for both managers, the simulator's in-process instances (shunter/cluster/groups.py) and the
torch instance processes (shunter/cluster/remote_groups.py); it lives here, below both, because
the simulator's manager imports sim/ and the torch one must not."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define
class ClusterCounters:
    drops: int = 0
    restores: int = 0
    groups_formed: int = 0
    kv_exchanged_bytes: int = 0
    adopted_requests: int = 0
    rescheduled_requests: int = 0
    """Queued requests (no KV) moved from an instance alone to a group's head."""
    restore_retries: int = 0
    faults: int = 0
    """Groups dissolved because a member was lost."""
    recomputed_requests: int = 0
    """Requests whose KV went with a lost member, prefilled again."""
    refused_drops: int = 0
    """Drops planned while a fault's reload was under way and an instance of the plan was
    still reloading its layers (not carried out; the monitor plans again)."""
    kv_moved_from: dict[int, int] = attrs.field(factory=dict)
    kv_moved_seen: dict[int, int] = attrs.field(factory=dict)
    """Torch instances: each one's count of the KV bytes moved between the members of the
    groups it led (gpu/kv_moved.py: every member's transfers, each byte once), when first
    seen (it joined, or this front door attached) and last seen (read after each group it leads
    forms, grows or restores); `kv_exchanged_bytes` sums the differences (`note_kv_moved`). An
    instance gone keeps what was last seen."""
    timeline: list[dict] = attrs.field(factory=list)
    """Per monitor round: time, each instance's used blocks and pool, its group."""
    events: list[dict] = attrs.field(factory=list)

    def note_kv_moved(self, instance: int, moved: int) -> None:
        """Instance `instance`'s running count of KV moved in the groups it led is `moved`."""
        self.kv_moved_from.setdefault(instance, moved)  # the first look: what it moved before
        self.kv_moved_seen[instance] = moved
        self.kv_exchanged_bytes = sum(n - self.kv_moved_from[i]
                                      for i, n in self.kv_moved_seen.items())

    def block(self, t0: float) -> dict[str, Any]:
        """The counts and the events (times from `t0`) of the `cluster` block; each manager
        adds what it alone measures."""
        return {"drops": self.drops, "restores": self.restores,
                "groups_formed": self.groups_formed,
                "kv_exchanged_bytes": self.kv_exchanged_bytes,
                "adopted_requests": self.adopted_requests,
                "rescheduled_requests": self.rescheduled_requests,
                "restore_retries": self.restore_retries, "faults": self.faults,
                "recomputed_requests": self.recomputed_requests,
                "refused_drops": self.refused_drops,
                "events": [dict(e, t=e["t"] - t0) for e in self.events]}
