"""One member's translation from the group's block ids (what the head's allocator hands out)
to the stage blocks of its re-viewed arena (gpu/stage_view.py).

A group id gets its stage block the first time this member sees it and keeps it for the group's
lifetime, so a block the allocator frees and hands out again (or keeps as a cached prefix) still
means the same memory. Blocks already holding this member's layers of a request's KV are
*reserved* for that request: when its table arrives, its entries take those blocks, so the KV
is used where it lies. When an entry was mapped before (the allocator reused a group id
already seen), the id moves onto the reserved block if no live table on this member still holds
it (its old stage block is then free); only when one does (a shared prefix block) is the KV
copied, and counted. Free blocks are handed out in `StageView.resplit_first` order: first those
whose KV a later re-split to a smaller stride keeps in place (gpu/kept_kv.py).

As the group restores: the head's pool shrinking back moves ids (`move`: the stage block follows
the id, no copy), and a restore prefetch (gpu/restore_prefetch.py) vacates the dropped layers'
stage blocks (`evacuate`): the ids there move out, and those blocks are never handed out again.
On the head each id then goes *home* (`home`, `place`): to the stage block whose layers lie where
its solo block's do, so the restore's step finds the head's kept KV in place (gpu/kept_kv.py
`own_moves`) and copies none; an id vacated goes there directly, one mapped anew too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from gpu.stage_view import StageView


class BlockMap:
    def __init__(self, view: StageView, group: range) -> None:
        if view.capacity < len(group):
            raise ValueError(f"a member with {view.capacity} stage blocks cannot hold a group "
                             f"pool of {len(group)} blocks")
        self.group = group
        self._local = np.full(group.stop, -1, dtype=np.int64)
        self._taken = np.zeros(view.num_blocks, dtype=bool)
        self._blocked = np.zeros(view.num_blocks, dtype=bool)
        """Stage blocks given back to weights (`evacuate`): never free again."""
        order = view.resplit_first() if hasattr(view, "resplit_first") else view.usable
        self._free = [int(b) for b in order[::-1]]  # pop() takes them in that order
        self._reserved: dict[int, list[int]] = {}
        self.copied_blocks = 0
        """Blocks of kept KV that had to be copied (a reserved block could not be used)."""
        self._home: Callable[[int], int | None] | None = None
        self._homes: set[int] = set()
        self.placed_blocks = self.aside_blocks = 0
        """`place`'s copies: onto homes, and aside (off another id's home, a cycle's)."""

    def pin(self, group_id: int, local: int) -> None:
        """Map `group_id` to `local` now (KV already there)."""
        self._check(group_id)
        if self._local[group_id] >= 0 or self._taken[local]:
            raise ValueError(f"group block {group_id} or stage block {local} is mapped already")
        self._local[group_id] = local
        self._taken[local] = True

    def reserve(self, request_id: int, locals_: Iterable[int | None]) -> None:
        """Stage blocks holding `request_id`'s KV, in table order, for when its table comes.
        None: no block holds that entry's KV in place (`fresh` gives it one to copy it into)."""
        held = list(locals_)
        for b in held:
            if b is not None and self._taken[b]:
                raise ValueError(f"stage block {b} is mapped already")
            if b is not None:
                self._taken[b] = True
        self._reserved[request_id] = held

    def fresh(self, request_id: int) -> list[tuple[int, int]]:
        """(entry, stage block): a free block reserved now for each entry of `request_id`'s
        reservation that had none, for its KV to be copied into. Call it once every block
        holding KV in place is reserved or pinned (none is then taken from under them)."""
        held, out = self._reserved.get(request_id, []), []
        for i, b in enumerate(held):
            if b is None:
                held[i] = self._pop()
                out.append((i, held[i]))
        return out

    def assign(self, request_id: int, index: int, group_id: int,
               in_use: Callable[[int], bool] = lambda _: True) -> tuple[int, int] | None:
        """Map table entry `index` of `request_id` (group id `group_id`). Returns (src, dst)
        stage blocks to copy when the request's reserved block could not be used: only when
        `group_id` is mapped already and `in_use(group_id)` says a live table still holds it."""
        self._check(group_id)
        held = self._reserved.get(request_id)
        want = held[index] if held is not None and index < len(held) else None
        if want is not None and want < 0:  # (used already)
            want = None
        mapped = int(self._local[group_id])
        if want is None:
            if mapped < 0:
                self._local[group_id] = self._fresh(group_id)
            return None
        if mapped >= 0 and in_use(group_id):
            self.copied_blocks += 1
            return (want, mapped)
        if mapped >= 0:  # the id's old block held KV nobody reads any more
            self._release(mapped)
        self._local[group_id] = want
        held[index] = -1
        return None

    def done_reserving(self, request_id: int) -> None:
        """The request's table is placed: blocks of its reservation left unused are free."""
        for b in self._reserved.pop(request_id, ()):
            if b is not None and b >= 0:
                self._release(b)

    def move(self, moves: Iterable[tuple[int, int]]) -> None:
        """The engine's shrinking pool moved table entries from group id `src` to `dst` (each
        (src, dst); engine/memory/block_pool.py `resize`): `dst` now means `src`'s stage block,
        no copy; `src` is unmapped, and `dst`'s old block (stale KV) is free again."""
        for src, dst in moves:
            self._check(src)
            self._check(dst)
            local = int(self._local[src])
            if local < 0:
                raise KeyError(f"group block {src} moved to {dst} has no stage block on this "
                               f"member")
            old = int(self._local[dst])
            if old >= 0:
                self._release(old)
            self._local[dst], self._local[src] = local, -1

    def evacuate(self, avoid: np.ndarray, pool: range) -> list[tuple[int, int]]:
        """Stage blocks `avoid` (a bool per stage block) are taken from KV for good (a restore
        writes weights there: gpu/restore_prefetch.py): every group id in `pool` mapped into
        them, and every block reserved for a request's kept KV there, moves to a free block
        outside (returned as (src, dst) stage blocks, for the caller to copy), ids beyond
        `pool` are unmapped (the engine's pool no longer holds them), and no block of `avoid`
        is handed out again."""
        for g in np.flatnonzero(self._local >= 0):
            if int(g) not in pool:
                self._release(int(self._local[g]))
                self._local[g] = -1
        ids = [int(g) for g in np.flatnonzero(self._local >= 0) if avoid[self._local[g]]]
        held = [(rid, i) for rid, h in self._reserved.items() for i, b in enumerate(h)
                if b is not None and b >= 0 and avoid[b]]
        free_outside = int(np.count_nonzero(~self._taken & ~avoid))
        if len(ids) + len(held) > free_outside:
            raise RuntimeError(f"{len(ids) + len(held)} blocks must leave the dropped layers' "
                               f"memory and only {free_outside} stage blocks outside it are "
                               f"free (the pool of {len(pool)} blocks is larger than this "
                               f"member holds without them)")
        self._blocked = avoid.copy()
        self._taken |= avoid
        out = []
        for g in ids:
            src, dst = int(self._local[g]), self._fresh(g)
            self._local[g] = dst
            out.append((src, dst))
        for rid, i in held:  # (an adopted request whose table has not come yet)
            src, dst = self._reserved[rid][i], self._pop()
            self._reserved[rid][i] = dst
            out.append((src, dst))
        return out

    def home(self, where: Callable[[int], int | None], pool: range) -> None:
        """From now on an id of `pool` this map gives a block (anew, or moving it: `evacuate`,
        `place`) gets the stage block `where(id)` names when that one is free, and others
        avoid those blocks (the head's restore: the block whose layers lie where the id's solo
        block's do, so its kept KV needs no copy then: gpu/kept_kv.py `own_moves`)."""
        self._home = where
        self._homes = {h for g in pool if (h := where(g)) is not None}

    def place(self, pool: range) -> list[tuple[int, int]]:
        """Move every mapped id of `pool` whose home (`home`) is elsewhere there: (src, dst)
        stage blocks, for the caller to copy in this order (each dst is free when its copy
        comes: `_order`, as `copy_order`). An id on another's home steps aside to a free block
        that is no id's home first (a cycle of ids on each other's homes costs one copy more);
        an id whose home a reservation holds, or names no usable block, stays where it is."""
        homes = {g: h for g in pool if self._local[g] >= 0
                 and (h := self._home(g)) is not None and not self._blocked[h]}
        at = {int(self._local[g]): int(g) for g in np.flatnonzero(self._local >= 0)}
        moves = [(int(self._local[g]), h) for g, h in homes.items() if self._local[g] != h]
        srcs = {src for src, _ in moves}
        held = {h for _, h in moves if self._taken[h] and h not in srcs}

        def go(src: int, dst: int) -> None:  # (as each copy comes: its src is free again)
            g = at.pop(src)
            at[dst], self._local[g] = g, dst
            self._taken[dst] = True
            self._release(src)
            if homes.get(g) == dst:
                self.placed_blocks += 1
            else:
                self.aside_blocks += 1

        return _order(moves, lambda avoid: self.spare(self._homes | avoid), held,
                      aside=held & set(at), done=go)[0]

    def _fresh(self, group_id: int) -> int:
        """A free stage block for `group_id`: its home if free (after `home`), else one that is
        no pool id's home if any is free, else any."""
        if self._home is not None:
            h = self._home(group_id)
            if h is not None and not self._taken[h] and not self._blocked[h]:
                self._taken[h] = True
                return h
            b = self.spare(self._homes)
            if b is not None:
                return b
        return self._pop()

    def spare(self, avoid: set[int]) -> int | None:
        """A free stage block outside `avoid`, taken now (None: none is left)."""
        for i in range(len(self._free) - 1, -1, -1):
            b = self._free[i]
            if not self._taken[b] and b not in avoid:
                del self._free[i]
                self._taken[b] = True
                return b
        return None

    def _release(self, local: int) -> None:
        if not self._blocked[local]:
            self._taken[local] = False
            self._free.append(local)

    def local(self, group_id: int) -> int:
        b = int(self._local[group_id])
        if b < 0:
            raise KeyError(f"group block {group_id} has no stage block on this member")
        return b

    def locals(self, table: Iterable[int]) -> list[int]:
        return [self.local(g) for g in table]

    def _pop(self) -> int:
        while self._free:
            b = self._free.pop()
            if not self._taken[b]:
                self._taken[b] = True
                return b
        raise RuntimeError("no free stage block left (the group pool was larger than this "
                           "member's capacity)")

    def _check(self, group_id: int) -> None:
        if group_id not in self.group:
            raise ValueError(f"block {group_id} is outside the group's block ids {self.group}")


def copy_order(moves: Iterable[tuple[int, int]],
               spare: Callable[[set[int]], int | None]) -> list[tuple[int, int]] | None:
    """(src, dst) block copies, every dst distinct, in an order to run them one at a time in
    which none overwrites a src still to be read: a copy whose dst another still reads waits;
    a cycle goes round a spare block (`spare(avoid)`: a free block outside `avoid`; None when
    none is left, and then this returns None)."""
    order, left = _order(moves, spare)
    return None if left else order


def _order(moves: Iterable[tuple[int, int]], spare: Callable[[set[int]], int | None],
           held: Iterable[int] = (), aside: Iterable[int] = (),
           done: Callable[[int, int], None] = lambda src, dst: None
           ) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """The one mechanism of `copy_order` and `BlockMap.place`: (src, dst) copies (every dst
    distinct) in an order to run them one at a time in which none overwrites a block still to
    be read, and the moves left undone (src -> dst). A move waits while its dst is a src still
    to be read or `held` (by a block that does not move). When none can go, the block on the
    first waiting move's dst steps aside to a spare block (`spare(avoid)`, avoiding every src
    and dst left): a src still to be read (a cycle: it goes on to its dst from there) or a
    held block of `aside` (it stays there). Left: moves waiting on a held block not in `aside`,
    or every waiting one once no spare is left. `done(src, dst)` follows each copy as it is
    ordered (before the next spare is asked for)."""
    todo = {s: d for s, d in moves if s != d}
    held, aside = set(held), set(aside)
    out: list[tuple[int, int]] = []
    while todo:
        went = False
        for s in list(todo):  # (a dst read earlier in this pass is free for a later move)
            if todo[s] not in todo and todo[s] not in held:
                out.append((s, todo.pop(s)))
                done(*out[-1])
                went = True
        if went:
            continue
        on = next((d for d in todo.values() if d in todo or d in aside), None)
        b = None if on is None else spare(set(todo) | set(todo.values()))
        if b is None:
            break
        out.append((on, b))
        done(on, b)
        if on in todo:  # (it keeps its place in the order)
            todo = {b if s == on else s: d for s, d in todo.items()}
        else:
            held.discard(on)
            aside.discard(on)
    return out, todo
