"""Dynamic Block Group Manager (FastSwitch §3.1): KV blocks handed out in block groups, runs of
contiguous block ids, so that moving a request's KV takes a few large copies instead of one per
block (the arena is block-major, so a run of block ids is one contiguous byte range).

Each request owns a list of groups; the last one is its *active* group, reserved larger than
needed (an expected size, 60 blocks by default) so the request grows inside it. The reserved but
unused tail of an active group still counts as free: when no free group fits a new request, the
largest such tail is split off and given away. Freed groups merge with free neighbours, as in a
buddy allocator.

The interface is the one `BlockPool` has (`allocate`, `free`, `table`, `num_free`, ...), so block
tables stay the interface to attention, plus `runs()` for the swap path.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs

from engine.memory.block_pool import BlockPoolError


@attrs.define(slots=True)
class BlockGroup:
    start: int
    reserved: int
    """Blocks set aside for the owner: [start, start + reserved)."""
    used: int = 0
    """Blocks the owner has filled: [start, start + used)."""

    @property
    def spare(self) -> int:
        return self.reserved - self.used


class FreeRuns:
    """Free block ids as disjoint, non-adjacent runs, merged on insertion."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._length: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._starts)

    def runs(self) -> list[tuple[int, int]]:
        return [(s, self._length[s]) for s in self._starts]

    def add(self, start: int, length: int) -> None:
        if length <= 0:
            return
        i = bisect.bisect_left(self._starts, start)
        if i > 0:  # merge with the run before
            prev = self._starts[i - 1]
            if prev + self._length[prev] == start:
                start, length = prev, self._length.pop(prev) + length
                self._starts.pop(i - 1)
                i -= 1
        if i < len(self._starts) and start + length == self._starts[i]:  # and the run after
            length += self._length.pop(self._starts.pop(i))
        self._starts.insert(i, start)
        self._length[start] = length

    def take(self, want: int) -> tuple[int, int] | None:
        """The smallest run holding `want` blocks (its first `want`), else the largest run whole."""
        start = self.fitting(want)
        if start is None:
            start = self.largest()
        return None if start is None else self.take_at(start, want)

    def fitting(self, want: int) -> int | None:
        """Start of the smallest run holding `want` blocks, or None."""
        fits = [s for s in self._starts if self._length[s] >= want]
        return min(fits, key=self._length.__getitem__) if fits else None

    def largest(self) -> int | None:
        """Start of the longest run, or None when nothing is free."""
        return max(self._starts, key=self._length.__getitem__) if self._starts else None

    def length(self, start: int) -> int:
        return self._length[start]

    def take_at(self, start: int, want: int) -> tuple[int, int]:
        """The first `want` blocks (or all, if fewer) of the run starting at `start`."""
        length = self._length[start]
        got = min(want, length)
        self._remove(start)
        self.add(start + got, length - got)
        return start, got

    def _remove(self, start: int) -> None:
        del self._length[start]
        self._starts.pop(bisect.bisect_left(self._starts, start))


def coalesce(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(device block, host block) pairs -> (device start, host start, count) runs, consecutive on
    both sides, in the order given."""
    runs: list[tuple[int, int, int]] = []
    for g, c in pairs:
        if runs and runs[-1][0] + runs[-1][2] == g and runs[-1][1] + runs[-1][2] == c:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((g, c, 1))
    return runs


class BlockGroupManager:
    """Free-group manager (`FreeRuns`) + used-group manager (each request's groups)."""

    def __init__(self, block_ids: range, *, expected_group: int = 60,
                 split_tails: bool = True) -> None:
        if len(block_ids) == 0:
            raise BlockPoolError("a block pool needs at least one block")
        self._all = block_ids
        self._free = FreeRuns()
        self._free.add(block_ids.start, len(block_ids))
        self._groups: dict[int, list[BlockGroup]] = {}
        self._expected: dict[int, int] = {}
        self._used = 0
        self.expected_group = expected_group
        self.split_tails = split_tails
        """Split a used group's spare tail before taking a free group shorter than wanted."""

    @property
    def num_total(self) -> int:
        return len(self._all)

    @property
    def num_allocated(self) -> int:
        return self._used

    @property
    def num_free(self) -> int:
        """Blocks nobody has filled: free runs plus the spare tails of active groups."""
        return len(self._all) - self._used

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def expect(self, request_id: int, blocks: int) -> None:
        """Hint: the request will probably need about `blocks` blocks in all (sizes its next group)."""
        self._expected[request_id] = blocks

    def table(self, request_id: int) -> list[int]:
        return [b for g in self._groups.get(request_id, ()) for b in range(g.start, g.start + g.used)]

    def runs(self, request_id: int) -> list[tuple[int, int]]:
        """The request's blocks as (first block id, count) runs, in token order; adjacent groups
        are one run."""
        out: list[tuple[int, int]] = []
        for g in self._groups.get(request_id, ()):
            if g.used == 0:
                continue
            if out and out[-1][0] + out[-1][1] == g.start:
                out[-1] = (out[-1][0], out[-1][1] + g.used)
            else:
                out.append((g.start, g.used))
        return out

    def groups(self, request_id: int) -> list[BlockGroup]:
        return list(self._groups.get(request_id, ()))

    def allocate(self, request_id: int, n: int) -> list[int]:
        if n > self.num_free:
            raise BlockPoolError(f"request {request_id} asked for {n} blocks, {self.num_free} free")
        groups = self._groups.setdefault(request_id, [])
        got: list[int] = []
        while len(got) < n:
            if groups and groups[-1].spare:
                g = groups[-1]
                k = min(g.spare, n - len(got))
                got.extend(range(g.start + g.used, g.start + g.used + k))
                g.used += k
                self._used += k
                continue
            groups.append(self._new_group(request_id, n - len(got)))
        return got

    def _new_group(self, request_id: int, need: int) -> BlockGroup:
        """FastSwitch §3.1: a free group that matches the size wanted first; when none does,
        the spare tail of another request's active group is split, if that is longer than the
        longest free group (else the longest free group is taken whole). `split_tails=False`
        keeps the older order, any free group before any split (measured against each other
        in bench/block_group_order.py)."""
        target = max(need, self._target_size(request_id))
        free = self._free
        start = free.fitting(target)
        if start is not None:
            return BlockGroup(start=start, reserved=free.take_at(start, target)[1])
        donor = self._donor()
        longest = free.largest()
        short = 0 if longest is None else free.length(longest)
        if donor is not None and (longest is None or (self.split_tails and donor.spare > short)):
            start, length = self._split(donor, target if self.split_tails else need)
        else:
            start, length = free.take_at(longest, target)  # type: ignore[arg-type]
        return BlockGroup(start=start, reserved=length)

    def _target_size(self, request_id: int) -> int:
        """The expected size, shrunk when free space is scarce so one request cannot reserve
        what many need (FastSwitch adjusts by 'the current availability of free KV cache')."""
        have = sum(g.used for g in self._groups.get(request_id, ()))
        expected = self._expected.get(request_id, self.expected_group)
        want = max(1, expected - have)
        return min(want, max(1, self.num_free // 4))

    def _donor(self) -> BlockGroup | None:
        """The active group with the most spare blocks, if any has some."""
        return max((gs[-1] for gs in self._groups.values() if gs and gs[-1].spare),
                   key=lambda g: g.spare, default=None)

    @staticmethod
    def _split(donor: BlockGroup, want: int) -> tuple[int, int]:
        """The last `want` spare blocks of `donor` (all of them if fewer): the donor keeps the
        blocks right after its used ones, so it still grows in place."""
        k = min(want, donor.spare)
        donor.reserved -= k
        return donor.start + donor.reserved, k

    def free(self, request_id: int) -> int:
        groups = self._groups.pop(request_id, [])
        self._expected.pop(request_id, None)
        used = sum(g.used for g in groups)
        for g in groups:
            self._free.add(g.start, g.reserved)
        self._used -= used
        return used

    def truncate(self, request_id: int, keep: int) -> int:
        """Give back every block of the request past its first `keep`, with the spare
        reservations of the groups cut; returns how many filled blocks were given back."""
        groups = self._groups.get(request_id, [])
        total = sum(g.used for g in groups)
        released = 0
        while groups and total > keep:
            g = groups[-1]
            before = total - g.used
            if before >= keep:  # the whole group goes
                groups.pop()
                self._free.add(g.start, g.reserved)
                cut = g.used
            else:  # its tail goes
                cut = total - keep
                g.used -= cut
                self._free.add(g.start + g.used, g.reserved - g.used)
                g.reserved = g.used
            released += cut
            total -= cut
        self._used -= released
        return released

    def rename(self, old: int, new: int) -> None:
        """Move `old`'s groups to `new` (which must own none)."""
        if self._groups.get(new):
            raise BlockPoolError(f"{new!r} already owns blocks")
        self._groups[new] = self._groups.pop(old, [])
        if old in self._expected:
            self._expected[new] = self._expected.pop(old)

    def owners(self) -> dict[int, list[int]]:
        return {rid: self.table(rid) for rid in self._groups}

    def free_runs(self) -> list[tuple[int, int]]:
        return self._free.runs()
