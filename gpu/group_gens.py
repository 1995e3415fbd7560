"""Seeded generators of the requests members hand over to a group's head (an `Adopted`'s
owner): the group's last stage samples them, so an owner that is not the last stage sends their
generators' states there as the group forms or grows (a group of three or more; a growth by two
or more instances alone). Without it the last stage started each one again from its seed.
A request handed over by a merging group (`Adopted.parts`) has its generator on that group's
last stage already, the merged group's last (gpu/group_merge.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gpu.data_plane import REPLY_TAG

GENERATORS_TAG = REPLY_TAG
"""On the group's own channel (the world's reply tag; nothing else on a channel uses it)."""


def _owned(start) -> dict[int, list[int]]:
    """Owner member index -> its handed-over request ids (theirs are sampled elsewhere)."""
    last, out = len(start.ranks) - 1, {}
    for a in start.adopted:
        if a.owner != last and not a.parts:
            out.setdefault(a.owner, []).append(a.request_id)
    return out


def hand_generators(plane, start, me: int, gens: Mapping[int, torch.Generator | None],
                    device: torch.device) -> dict[int, torch.Generator]:
    """Call while the group's stage is built, before any KV is queued. `gens`: this member's
    handed-over requests' generators (request id at the head -> generator or None). An owner
    that is not the last stage queues them to it (one tensor: a flag byte and the state per
    request); the last stage receives every owner's and returns the generators (request id ->
    generator); others return {}."""
    owned, last = _owned(start), len(start.ranks) - 1
    size = torch.Generator(device=device).get_state().numel()
    if me != last:
        rids = owned.get(me)
        if rids:
            buf = torch.zeros(len(rids), 1 + size, dtype=torch.uint8)
            for i, rid in enumerate(rids):
                if (g := gens.get(rid)) is not None:
                    buf[i, 0], buf[i, 1:] = 1, g.get_state()
            plane.queue.put(buf, dst=start.ranks[last], tag=GENERATORS_TAG, kind="kv")
        return {}
    out = {}
    for owner, rids in sorted(owned.items()):
        buf = torch.empty(len(rids), 1 + size, dtype=torch.uint8)
        plane.recv_tensor(buf, start.ranks[owner], GENERATORS_TAG,
                          "the handed-over requests' generators were due")
        for i, rid in enumerate(rids):
            if buf[i, 0]:
                out[rid] = g = torch.Generator(device=device)
                g.set_state(buf[i, 1:].clone())
    return out
