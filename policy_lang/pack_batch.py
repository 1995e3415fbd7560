"""The batch packing builds (policy_lang/packing.py, BROS §4.2 Alg. 1): what it holds so far
(requests, chunks, memory, the predicted shape) and the memory classes packed later may lend
(FindPreemptBlock)."""

from __future__ import annotations

import math

from engine.cost_model import CostModel
from engine.policy import RequestView, SchedulerView


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Batch:
    def __init__(self, view: SchedulerView, cost: CostModel | None, average_ms: float,
                 limit: int) -> None:
        self.cost, self.average_ms, self.limit = cost, average_ms, limit
        self.budget_tokens = view.max_batched_tokens
        self.tokens_left = view.max_batched_tokens
        self.decode_reserve = 0
        """Tokens a prompt chunk leaves for the decodes of its class packing has yet to try."""
        self.block_size = view.block_size
        self.now = view.now
        self.free = view.free_blocks
        self.reverse_free = view.reverse_free_blocks
        """Free blocks left for BE requests on a bidirectional table (None: no such table): a
        BE request starts only in wholly free blocks and a displaced one swaps back into them,
        while `free` also counts BE blocks RT may overwrite. Without it, BE requests took token
        budget for memory `fit` then could not give them (sim, tests/sim/test_bros_overload.py:
        62% of planned BE tokens left out)."""
        self.selected: list[RequestView] = []
        self.entries: list[tuple[int, tuple[int, int], int, float, int, int]] = []
        """Per selected request, in the same order: (class, chunk, blocks it needs, the budget
        it counts with toward min_slack (inf: none), blocks it brings back from the host,
        wholly free blocks it takes). One tuple per request: packing adds ~100 a iteration."""
        self.keys: list[int] = []
        """Per selected request: 2 x its class's pack rank, + 1 for a prompt chunk (the order
        the planner gives running requests their tokens in: `order`)."""
        self.shape = [0, 0, 0, 0, 0]
        """The batch's BatchShape as its five numbers (one built per try cost more than the
        prediction), kept summed: exact integers, so the same predictions."""
        self.copy_blocks = 0  # KV blocks the batch brings back from the host (swap, checkpoints)
        self.min_slack = math.inf
        self.ids: set[int] = set()
        self.reserved: dict[int, tuple[int, int]] = {}
        """request id -> (class, blocks) held back for a request that is late or did not fit:
        a request of its class behind it may not take those (each freed block going to a newer,
        smaller request starved it: a 15.6 s TTFT p99.9 under memory pressure). Other classes
        may: RT takes BE memory back anyway."""
        self.held: dict[int, int] = {}  # class -> blocks `reserved` holds for it, kept summed
        self.borrowers: set[int] = set()
        """Requests in the batch that took memory from a later class's requests."""
        self.lent: set[int] = set()
        """Requests whose memory was taken: they cannot join the batch."""

    def full(self) -> bool:
        return len(self.selected) >= self.limit or self.tokens_left <= 0

    def reserve(self, rid: int, cls: int, blocks: int) -> None:
        if rid not in self.reserved:
            self.reserved[rid] = (cls, blocks)
            self.held[cls] = self.held.get(cls, 0) + blocks

    def unreserve(self, rid: int) -> None:
        if (entry := self.reserved.pop(rid, None)) is not None:
            self.held[entry[0]] -= entry[1]

    def chunk(self, r: RequestView, extra_tokens: int = 0) -> tuple[int, int]:
        return r.computed_tokens, max(1, min(r.remaining_tokens, self.tokens_left + extra_tokens))

    def need(self, r: RequestView, chunk: tuple[int, int]) -> int:
        return max(0, _blocks(chunk[0] + chunk[1], self.block_size) - r.blocks)

    def reverse_need(self, r: RequestView, need: int) -> int:
        """Wholly free blocks r takes: RT takes those first; a BE request also its restore's
        blocks (at most one per checkpointed block). For a swapped-out BE request both terms
        count all its blocks, twice what its swap-in takes: kept on purpose, since asking only
        `need` swapped BE requests back in sooner and out again (bros_round11_be.md, variant d:
        A10 5 RT/s seed 9 BE 0.908 -> 0.705 req/s)."""
        if self.reverse_free is None:
            return 0
        if r.ttft_ms is None and r.tpot_ms is None:
            return need + r.checkpointed_blocks
        return min(need, self.reverse_free)

    def reverse_short(self, r: RequestView, need: int, extra: int = 0) -> bool:
        """A BE request whose blocks are not wholly free (`fit` would leave it out)."""
        if self.reverse_free is None or r.ttft_ms is not None or r.tpot_ms is not None:
            return False
        return self.reverse_need(r, need) > self.reverse_free + extra

    def iterations(self, r: RequestView, chunk: tuple[int, int]) -> int:
        """Iterations until r's current token: this one, then the rest of its prefill."""
        rest = r.remaining_tokens - chunk[1]
        return 1 + (_blocks(rest, self.budget_tokens) if rest > 0 else 0)

    def predict(self, shape: list[int], copies: int = 0) -> float:
        """max(model, copy) for a batch of `shape` that brings `copies` more blocks back
        from the host (§4.1)."""
        if self.cost is None:
            return self.average_ms
        return self.cost.iteration_of(*shape, self.copy_blocks + copies)

    def add(self, r: RequestView, cls: int, chunk: tuple[int, int], need: int,
            budget: float, copies: int, shape: list[int], key: int) -> None:
        """`shape`: the batch's with r in it; `key`: r's place in `order`."""
        take = 0
        if self.reverse_free is not None and (need or r.checkpointed_blocks):  # else 0
            take = self.reverse_need(r, need)
            self.reverse_free = max(0, self.reverse_free - take)
        self.selected.append(r)
        self.entries.append((cls, chunk, need, budget, copies, take))
        self.keys.append(key)
        self.copy_blocks += copies
        self.ids.add(r.id)
        self.shape = shape
        self.tokens_left -= chunk[1]
        self.free -= need
        if budget < self.min_slack:  # min(self.min_slack, budget)
            self.min_slack = budget

    def remove(self, i: int) -> None:
        _, chunk, need, budget, copies, take = self.entries[i]
        self.tokens_left += chunk[1]
        self.shape = plus(self.shape, chunk, -1)
        self.free += need
        self.ids.discard(self.selected[i].id)
        self.copy_blocks -= copies
        if self.reverse_free is not None:
            self.reverse_free += take
        del self.selected[i], self.entries[i], self.keys[i]
        self.min_slack = self.min_slack_without(i, budget, removed=True)

    def min_slack_without(self, i: int, budget: float, *, removed: bool = False) -> float:
        """min_slack over the batch but request i (whose `budget` is given; `removed`: it is
        already out of `entries`). Where i's budget exceeds min_slack another request holds the
        minimum, so no pass over the batch (`_replace` asks once for each candidate)."""
        if budget > self.min_slack:
            return self.min_slack
        entries = self.entries
        return min((e[3] for j, e in enumerate(entries) if removed or j != i), default=math.inf)

    def last_of(self, cls: int) -> int | None:
        """The index of the last selected request of class `cls`."""
        entries = self.entries
        for i in range(len(entries) - 1, -1, -1):
            if entries[i][0] == cls:
                return i
        return None

    def order(self) -> list[RequestView]:
        """The selected requests by class in pack order and, within a class, decodes before
        prompt chunks, each run in the order packed (a stable sort by `keys`, in C)."""
        keys, selected = self.keys, self.selected
        return list(map(selected.__getitem__, sorted(range(len(keys)), key=keys.__getitem__)))


class Lender:
    """Blocks a class may take from running requests of classes packed after it and left out
    of the batch (FindPreemptBlock): the least deserving lender first."""

    def __init__(self, groups: list[list[RequestView]], pack_rank: list[int]) -> None:
        self._groups, self._pack_rank = groups, pack_rank
        self._lenders: list[list[RequestView]] | None = None
        self.claimed: set[int] = set()

    @property
    def _by_rank(self) -> list[list[RequestView]]:
        """Running requests holding blocks, by pack rank: found when first asked (most
        iterations never ask: every request that tries fits)."""
        if self._lenders is None:
            self._lenders = [[] for _ in range(max(self._pack_rank) + 2)]
            for cls, group in enumerate(self._groups):
                self._lenders[self._pack_rank[cls]] += [
                    r for r in group if r.state == "running" and r.blocks]
        return self._lenders

    def available(self, rank: int) -> int:
        return sum(r.blocks for lenders in self._by_rank[rank + 1:] for r in lenders
                   if r.id not in self.claimed)

    def claim(self, rank: int, blocks: int, batch_ids: set[int]) -> None:
        for lenders in reversed(self._by_rank[rank + 1:]):
            for r in reversed(lenders):
                if blocks <= 0:
                    return
                if r.id not in self.claimed and r.id not in batch_ids:
                    self.claimed.add(r.id)
                    blocks -= r.blocks


def copies_of(r: RequestView) -> int:
    """Blocks r brings back from the host if it runs: all its KV when swapped out, else its
    lazily checkpointed blocks (BROS §5.2)."""
    return r.swapped_blocks if r.state == "swapped" else r.checkpointed_blocks


def plus(shape: list[int], chunk: tuple[int, int], sign: int) -> list[int]:
    """BatchShape's numbers with one sequence (cached `start` tokens, `n` new) added (sign 1)
    or taken out (-1): one new token is a decode."""
    pt, psq, ppre, ds, dc = shape
    start, n = chunk
    if n == 1:
        return [pt, psq, ppre, ds + sign, dc + sign * (start + 1)]
    return [pt + sign * n, psq + sign * n * n, ppre + sign * n * start, ds, dc]
