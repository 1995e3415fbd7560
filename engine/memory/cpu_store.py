"""CPU copies of KV, reused across swaps and conversation turns (FastSwitch §3.3).

The host swap space is managed in block groups too (`BlockGroupManager` over CPU block ids), so a
copy is a few runs and has room reserved next to it for the next increment. A copy is *sole* while
its request is swapped out (the only copy: never touched) and a *backup* once the request is back
on the device or its turn has ended. When space runs short, a more deserving request takes the
tail of less deserving backups: those copies are *contaminated* from that point and only their
valid prefix is reused afterwards.

Pure mechanism: it decides which CPU blocks hold what; the swap pool moves the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import attrs

from engine.memory.block_groups import BlockGroupManager


@attrs.define(slots=True)
class CpuCopy:
    key: Hashable
    valid_tokens: int = 0
    """Tokens [0, valid_tokens) of the owner's KV are held correctly by the copy."""
    sole: bool = False
    rank: float = math.inf
    """How deserving the owner is (smaller is more); backups of worse rank are taken first."""
    contaminated: bool = False


@attrs.frozen(kw_only=True)
class SwapOutPlan:
    first_block: int
    """Index (in the owner's block table) of the first block to copy: earlier ones are reused."""
    cpu_blocks: tuple[int, ...]
    """Destination CPU blocks for block indices first_block, first_block + 1, ..."""
    reused_blocks: int


class CpuCopyStore:
    def __init__(self, block_ids: range, block_size: int, *, expected_group: int = 60) -> None:
        self._space = BlockGroupManager(block_ids, expected_group=expected_group)
        self._copies: dict[Hashable, CpuCopy] = {}
        self.block_size = block_size
        self.contaminations = 0

    @property
    def num_free(self) -> int:
        return self._space.num_free

    @property
    def num_total(self) -> int:
        return self._space.num_total

    def get(self, key: Hashable) -> CpuCopy | None:
        return self._copies.get(key)

    def blocks(self, key: Hashable) -> list[int]:
        return self._space.table(key)

    def valid_blocks(self, key: Hashable) -> int:
        """Leading blocks whose every slot is valid (a partial last block must be copied again)."""
        c = self._copies.get(key)
        return 0 if c is None else c.valid_tokens // self.block_size

    def prepare_swap_out(self, key: Hashable, tokens: int, *, rank: float,
                         expected_blocks: int | None = None) -> SwapOutPlan | None:
        """Make room for the owner's first `tokens` tokens, reusing what is valid; marks the copy
        sole and valid up to `tokens`. None (and nothing changed) if it cannot fit."""
        need = -(-tokens // self.block_size)
        first = min(self.valid_blocks(key), need)
        have = len(self._space.table(key))
        grow = max(0, need - have)
        if grow > self._space.num_free and not self._contaminate(key, grow, rank):
            return None
        if expected_blocks is not None:
            self._space.expect(key, expected_blocks)
        if have > need:
            self._space.truncate(key, need)
        if grow:
            self._space.allocate(key, grow)
        copy = self._copies.setdefault(key, CpuCopy(key=key))
        copy.valid_tokens, copy.sole, copy.rank = tokens, True, rank
        return SwapOutPlan(first_block=first, cpu_blocks=tuple(self._space.table(key)[first:need]),
                           reused_blocks=first)

    def _contaminate(self, key: Hashable, grow: int, rank: float) -> bool:
        """Take tail blocks of backups less deserving than `rank` until `grow` blocks are free."""
        victims = sorted((c for c in self._copies.values()
                          if not c.sole and c.key != key and c.rank > rank),
                         key=lambda c: -c.rank)
        if self._space.num_free + sum(len(self._space.table(c.key)) for c in victims) < grow:
            return False
        for c in victims:
            short = grow - self._space.num_free
            if short <= 0:
                break
            table = len(self._space.table(c.key))
            keep = max(0, table - short)
            self._space.truncate(c.key, keep)
            c.valid_tokens = min(c.valid_tokens, keep * self.block_size)
            c.contaminated = True
            self.contaminations += 1
            if keep == 0:
                self.drop(c.key)
        return True

    def mark_backup(self, key: Hashable, *, valid_tokens: int | None = None, rank: float = math.inf) -> None:
        """The owner's KV is on the device again (or its turn ended): the copy is now a backup,
        valid for at most `valid_tokens` tokens."""
        c = self._copies[key]
        c.sole, c.rank = False, rank
        if valid_tokens is not None:
            c.valid_tokens = min(c.valid_tokens, valid_tokens)

    def keep_prefix(self, key: Hashable, tokens: int, *, rank: float) -> None:
        """Keep only the copy's first `tokens` tokens (whole blocks) for a new owner that will
        swap them in (a conversation's next turn): the copy is sole again until then."""
        c = self._copies[key]
        self._space.truncate(key, -(-tokens // self.block_size))
        c.valid_tokens = min(c.valid_tokens, tokens)
        c.sole, c.rank = True, rank

    def set_rank(self, key: Hashable, rank: float) -> None:
        c = self._copies.get(key)
        if c is not None:
            c.rank = rank

    def rekey(self, old: Hashable, new: Hashable) -> None:
        """Hand a copy to a new owner (a conversation's next turn); `new` loses any copy it had."""
        if new in self._copies:
            self.drop(new)
        c = self._copies.pop(old)
        c.key = new
        self._copies[new] = c
        self._space.rename(old, new)

    def drop(self, key: Hashable) -> None:
        self._copies.pop(key, None)
        self._space.free(key)

    def keys(self) -> list[Hashable]:
        return list(self._copies)
