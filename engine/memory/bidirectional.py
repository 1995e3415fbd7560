"""Bidirectional KV blocks (BROS §5): one block shared by a real-time (RT) and a best-effort (BE)
request, RT filling its slots from the left and BE from the right; block preemption and lazy
checkpointing of exactly the BE slots RT overwrites.

Pure mechanism, no I/O: it answers `can_*`, does the change, and returns the slot copies the
change needs (flat slot addresses, `block * block_size + offset`, on the device and in the host
checkpoint space), which the caller must run in the order given and before the step that writes.

- A block table entry carries the direction: `b` is block b read left to right, `-b - 1` the
  same block read right to left (engine/memory/slot_runs.py), so no direction tensor is needed
  (the paper keeps one, §6). Logical offset i of a reversed entry is slot `block_size - 1 - i`.
- Per block (the *preemption table* of §5.2): its RT owner and fill, its BE owner and fill, and
  the BE slots RT has overwritten (`lost`), each checkpointed to a host slot first.
- Placement (§5.2 FindBlock/FindPreemptBlock): BE takes free blocks (the most empty slots);
  when none is left, its last, partly filled block may be the empty right side of an RT block
  (the RT-only block with the most empty slots: a *guest*). RT takes a free block, else the BE
  block with the most empty slots (engine/memory/preemption_order.py). In a shared block,
  whichever came first, RT fills the empty slots first, then overwrites BE slots (block
  preemption), each copied to the host just before (lazy checkpointing).
- A BE request with overwritten slots is *displaced*: it cannot run until `restore` swaps back
  exactly its checkpointed slots (in place when the RT owner has left the block, else merged
  with its surviving slots into a fresh block). A BE request whose next slot is taken by an RT
  guest moves that block's live slots to a fresh block (`extend`).
- `swap_out` (§5.2's extreme case; the caller picks whom) copies every live slot of a request
  to the host and releases its blocks; `swap_in` brings them back into fresh blocks: whole
  blocks in block groups, shared ones slot-masked, when the table has a copy space
  (engine/memory/slot_swap.py).
"""

from __future__ import annotations

from engine.memory.host_slots import HostSlots
from engine.memory.preemption_order import preemption_order
from engine.memory.slot_owners import Block as _Block
from engine.memory.slot_owners import BidirectionalError
from engine.memory.slot_owners import Seq as _Seq
from engine.memory.slot_owners import SlotQueries, guest_block
from engine.memory.slot_swap import HostBlocks, SlotSwaps
from engine.memory.slot_runs import NO_COPIES, SlotCopies, decode, encode, physical_slot

__all__ = ["BidirectionalBlocks", "BidirectionalError", "SlotCopies", "decode", "encode",
           "physical_slot"]


class BidirectionalBlocks(SlotQueries, SlotSwaps):
    def __init__(self, block_ids: range, block_size: int, host_slots: int, *,
                 copy_blocks: range | None = None) -> None:
        if len(block_ids) == 0 or block_size < 1:
            raise BidirectionalError("a bidirectional table needs blocks and slots")
        self.block_size = block_size
        self._ids = block_ids
        self._blocks = {b: _Block() for b in block_ids}
        self._free = list(reversed(block_ids))  # blocks with no owner at all
        self._be_only: set[int] = set()  # blocks with a BE owner and no RT one
        self._holed: set[int] = set()  # blocks whose `lost` may be non-empty (a superset)
        self._displaced: set[int] = set()  # the blocks of displaced BE requests (kept, not rebuilt)
        self._free_host = HostSlots(host_slots)  # a block's checkpoints consecutive (host_slots.py)
        self._copy_space = HostBlocks(copy_blocks) if copy_blocks is not None else None
        """Host blocks for whole requests swapped out (engine/memory/slot_swap.py), after the
        checkpoint slots in the host space; None: they go out slot by slot to those slots."""
        self._seqs: dict[int, _Seq] = {}
        self._be: dict[int, _Seq] = {}  # the BE requests of `_seqs`, for block preemption's picks
        self.checkpointed_slots_total = 0
        """Slots copied to the host by lazy checkpointing since the start."""
        self.guest_blocks_total = 0
        """BE blocks placed in the empty right side of an RT block since the start."""
        self.guest_checkpointed_total = 0
        """Of `checkpointed_slots_total`, slots of such a guest its RT host overwrote."""
        self.copied: set[int] = set()
        """Requests whose KV a returned copy carries (checkpointed, moved, restored, swapped
        out or in), since the caller last cleared it: if those copies fail, their KV here is
        not what the table says (engine/bidirectional_step.py `step_failed`)."""

    # ------------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks with no owner."""
        return len(self._free)

    @property
    def num_total(self) -> int:
        return len(self._ids)

    @property
    def free_host_slots(self) -> int:
        return len(self._free_host)

    def requests(self) -> list[int]:
        return list(self._seqs)

    def __contains__(self, rid: int) -> bool:
        return rid in self._seqs

    def rt_room(self) -> int:
        """Blocks an RT request may still take: free ones and BE blocks without an RT guest."""
        return len(self._free) + len(self._be_only)

    # ------------------------------------------------------------------------ placement

    def add(self, rid: int, *, reverse: bool) -> None:
        """Register a request: `reverse` (BE) fills blocks right to left."""
        if rid in self._seqs:
            raise BidirectionalError(f"request {rid} is already in the table")
        self._seqs[rid] = _Seq(reverse=reverse)
        if reverse:
            self._be[rid] = self._seqs[rid]

    def _pick_rt_blocks(self, n: int) -> list[int]:
        """n blocks: free ones, then BE-only blocks by `_preempt_key` (block preemption; see
        engine/memory/preemption_order.py). One pass: no key changes while blocks are picked."""
        picked = [self._free.pop() for _ in range(min(n, len(self._free)))]
        return picked + (self._preemption_order(n - len(picked)) if n > len(picked) else [])

    def _preempt_key(self, b: int) -> tuple[bool, int, int]:  # largest first
        return self._preempt_keys([b])[0]

    def _preempt_keys(self, blocks: list[int]) -> list[tuple[bool, int, int]]:
        seqs, xs = self._seqs, self._blocks
        return [(bool(seqs[(x := xs[b]).be].host), len(x.lost) - x.be_fill, -b) for b in blocks]

    def _preemption_order(self, k: int) -> list[int]:
        last = [-s.table[-1] - 1 for s in self._be.values() if s.table]
        return preemption_order(k, self._be_only, self._holed, last, self._displaced,
                                self._preempt_keys)

    def _undisplace(self, s: _Seq) -> None:
        """s stops being displaced, or its blocks go (before `restore`, `swap_out`, `free`)."""
        if s.reverse and s.host and s.table:
            self._displaced.difference_update(map((-1).__sub__, s.table))

    def guest_block(self, slots: int) -> int | None:
        """Where a BE request's last block may go when no block is free (slot_owners.py)."""
        return guest_block(slots, self.block_size, self._seqs.values(), self._blocks)

    def _be_picks(self, rid: int, s: _Seq, tokens: int) -> tuple[int, int]:
        """(blocks a BE extension to `tokens` takes, slots of the last of them: 0 when full).
        The blocks are its last block moved away from an RT owner (if it must), then its new
        ones; all must be free but the last, which may be a guest block when it is partial."""
        return (-(-tokens // self.block_size) - len(s.table) + self._be_collides(rid, s, tokens),
                tokens % self.block_size)

    def can_extend(self, rid: int, tokens: int) -> bool:
        """Whether `extend(rid, tokens)` would find its blocks (and host slots to checkpoint)."""
        s = self._seqs[rid]
        if s.swapped or s.host:  # swapped, or displaced
            return False
        if s.reverse:
            blocks, tail = self._be_picks(rid, s, tokens)
            return blocks <= len(self._free) or (
                blocks == len(self._free) + 1 and tail > 0 and self.guest_block(tail) is not None)
        # each new token overwrites at most one BE slot, which needs a host slot first
        new = -(-tokens // self.block_size) - len(s.table)
        return new <= self.rt_room() and tokens - s.tokens <= len(self._free_host)

    def _be_collides(self, rid: int, s: _Seq, tokens: int) -> int:
        """1 when the BE request's last block must move because its RT owner (a guest, or the
        host of a BE guest) holds a slot it is about to write."""
        if not s.table or s.tokens % self.block_size == 0 or tokens <= s.tokens:
            return 0
        block, _ = decode(s.table[-1])
        x = self._blocks[block]
        last = min(tokens, len(s.table) * self.block_size) - 1
        lowest = self.block_size - 1 - last % self.block_size
        return int(x.rt >= 0 and x.rt_fill > lowest)

    def extend(self, rid: int, tokens: int, *, checked: bool = False) -> SlotCopies:
        """Make the request hold KV slots for `tokens` tokens (it is about to write positions
        `tokens()` .. `tokens - 1`). Returns the copies to run first: checkpoints of the BE slots
        an RT write overwrites, or a BE block moved away (`checked`: can_extend was asked)."""
        s = self._seqs[rid]
        if not checked and not self.can_extend(rid, tokens):
            raise BidirectionalError(f"request {rid} cannot grow to {tokens} tokens")
        copies, picks = NO_COPIES, ()
        if s.reverse:  # FindBlock: free ones, the last a guest block if none is left for it
            blocks, tail = self._be_picks(rid, s, tokens)
            picks = [self._free.pop() for _ in range(min(blocks, len(self._free)))]
            if len(picks) < blocks:
                picks.append(self.guest_block(tail))
                self.guest_blocks_total += 1
            if self._be_collides(rid, s, tokens):
                copies = self._move_last_block(rid, s, picks.pop(0))
        elif (new := -(-tokens // self.block_size) - len(s.table)) > 0:
            picks = self._pick_rt_blocks(new)
        for b in picks:
            self._own(b, rid, s.reverse)
            s.table.append(encode(b, s.reverse))
        return self._write(s, tokens, copies)

    def grow(self, rid: int, tokens: int) -> SlotCopies | None:
        """`extend` if `can_extend`, else None and no change: one look-up, and no block search
        when the request's blocks already hold `tokens` (most decodes of a step)."""
        s = self._seqs[rid]
        if s.swapped or s.host:
            return None
        pos, bs = s.tokens, self.block_size
        if (tokens == pos + 1 and pos % bs and not s.reverse and self._free_host
                and (j := pos // bs) < len(s.table) and (x := self._blocks[s.table[j]]).be < 0):
            x.rt_fill, s.tokens = pos % bs + 1, tokens  # an RT decode in its own block: `_write`
            return NO_COPIES
        if -(-tokens // bs) <= len(s.table) and (
                not self._be_collides(rid, s, tokens) if s.reverse
                else tokens - s.tokens <= len(self._free_host)):
            return self._write(s, tokens, NO_COPIES)
        return self.extend(rid, tokens, checked=True) if self.can_extend(rid, tokens) else None

    def _write(self, s: _Seq, tokens: int, copies: SlotCopies) -> SlotCopies:
        """Fill s's blocks up to `tokens` (they hold them), checkpointing BE slots RT reaches."""
        out, bs, pos, table, xs = [], self.block_size, s.tokens, s.table, self._blocks
        while pos < tokens:  # block by block; slot by slot only where RT meets a BE owner
            j = pos // bs
            end = min(tokens, (j + 1) * bs)
            if s.reverse:
                xs[-table[j] - 1].be_fill = end - j * bs
            else:
                (x := xs[table[j]]).rt_fill = end - j * bs
                if x.be >= 0 and end - j * bs > bs - x.be_fill:  # it reaches BE's live slots
                    out += self._checkpoint(table[j], x, range(pos - j * bs, end - j * bs))
            pos = end
        s.tokens = max(s.tokens, tokens)
        return copies + SlotCopies(out=tuple(out)) if out else copies

    def _checkpoint(self, block: int, x: _Block, offsets: range) -> list[tuple[int, int]]:
        """RT is about to write `offsets` of `block`: each that holds live BE KV is copied to a
        host slot first and marked overwritten (BROS §5.2, lazy checkpointing)."""
        be, bs, out = self._seqs[x.be], self.block_size, []
        index = be.table.index(encode(block, True))  # a BE table's entries are all reversed
        if not be.host:  # it becomes displaced here (its table changes only once it is not)
            self._displaced.update(map((-1).__sub__, be.table))
        for offset in offsets:
            if offset >= bs - x.be_fill and offset not in x.lost:
                pos = index * bs + bs - 1 - offset  # the slot before it is pos + 1's
                host = self._free_host.take(be.host.get(pos + 1) if offset else None, bs - offset)
                be.host[pos] = host
                x.lost.add(offset)
                self._holed.add(block)
                out.append((block * bs + offset, host))
        if out:
            self.copied.add(x.be)
        self.checkpointed_slots_total += len(out)
        self.guest_checkpointed_total += len(out) if x.guest else 0
        return out

    def _move_last_block(self, rid: int, s: _Seq, new: int) -> SlotCopies:
        """Move the BE request's last block's live slots to block `new` (an RT owner holds the
        slot it would write next)."""
        old, _ = decode(s.table[-1])
        assert new is not None and new != old
        self._release_be(old)
        self._own(new, rid, True)
        bs = self.block_size
        used = s.tokens - (len(s.table) - 1) * bs
        self._blocks[new].be_fill = used
        self.copied.add(rid)
        s.table[-1] = encode(new, True)
        return SlotCopies(move=tuple((old * bs + bs - 1 - i, new * bs + bs - 1 - i)
                                     for i in range(used)))

    # ------------------------------------------------------------------------ restore

    def restore_blocks_needed(self, rid: int) -> int:
        """Fresh blocks `restore` would take (blocks whose RT owner is still there)."""
        s = self._seqs[rid]
        return sum(1 for j in self._host_blocks(s) if self._blocks[decode(s.table[j])[0]].rt >= 0)

    def _host_blocks(self, s: _Seq) -> list[int]:
        return sorted({p // self.block_size for p in s.host})

    def can_restore(self, rid: int) -> bool:
        return self.displaced(rid) and self.restore_blocks_needed(rid) <= len(self._free)

    def restore(self, rid: int) -> SlotCopies:
        """Swap back exactly the request's checkpointed slots: in place where the RT owner has
        left the block, else merged with the block's surviving slots into a fresh block."""
        s = self._seqs[rid]
        if not self.can_restore(rid):
            raise BidirectionalError(f"request {rid} cannot be restored now")
        self._undisplace(s)
        self.copied.add(rid)
        bs, move, into = self.block_size, [], []
        for j in self._host_blocks(s):
            old, _ = decode(s.table[j])
            x = self._blocks[old]
            target = old
            if x.rt >= 0:
                fill, lost = x.be_fill, set(x.lost)
                self._release_be(old)
                target = self._free.pop()
                self._own(target, rid, True)
                self._blocks[target].be_fill = fill
                move += [(old * bs + o, target * bs + o)
                         for o in range(bs - fill, bs) if o not in lost]
                s.table[j] = encode(target, True)
            else:
                x.lost.clear()
                self._holed.discard(old)
            for i in reversed(range(bs)):  # by offset: a block's checkpoints are one run
                host = s.host.pop(j * bs + i, None)
                if host is not None:
                    into.append((host, target * bs + bs - 1 - i))
                    self._free_host.give((host,))
        return SlotCopies(move=tuple(move), into=tuple(into))

    # ------------------------------------------------------------------------ swap, free

    def free(self, rid: int) -> None:
        """The request ends: its slots and host checkpoints go back."""
        s = self._seqs.pop(rid)
        self._be.pop(rid, None)
        self._undisplace(s)
        self._release_all(s)
        self._free_host.give(s.host.values())
        if s.copy and self._copy_space is not None:
            self._copy_space.give(s.copy)

    def _release_all(self, s: _Seq) -> None:
        for e in s.table:
            block, rev = decode(e)
            if rev:
                self._release_be(block)
            else:
                self._release_rt(block)
        s.table.clear()

    def _own(self, block: int, rid: int, reverse: bool) -> None:
        x = self._blocks[block]
        if reverse:
            x.be, x.be_fill, x.guest = rid, 0, x.rt >= 0
            if x.rt < 0:
                self._be_only.add(block)
        else:
            x.rt, x.rt_fill = rid, 0
            self._be_only.discard(block)

    def _release_be(self, block: int) -> None:
        x = self._blocks[block]
        x.be, x.be_fill = -1, 0
        x.lost.clear()
        self._holed.discard(block)
        self._be_only.discard(block)
        if x.rt < 0:
            self._free.append(block)

    def _release_rt(self, block: int) -> None:
        x = self._blocks[block]
        x.rt, x.rt_fill, x.guest = -1, 0, False
        if x.be < 0:
            self._free.append(block)
        else:
            self._be_only.add(block)
