"""The prefix cache (engine/memory/prefix_cache.py) and the block pool's side of it, driven
together the way the scheduler and the allocator drive them, over random sequences: admit with
a prefix hit, compute and publish, preempt, end, evict. After every operation: each key's
holder count is the number of requests holding it, idle keys are evicted least recently
released first, no block a request holds is ever evicted or free, no block is lost, and a
request that takes cached blocks finds in them exactly the tokens it would have computed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.memory.block_pool import BlockPool, BlockPoolError
from engine.memory.prefix_cache import PrefixCache, PrefixCacheError, block_key
from tests.conftest import slow_scale

BS = 2
BLOCKS = 24


def test_a_key_depends_on_every_token_before_it():
    a, b = block_key(b"", [1, 2]), block_key(b"", [3, 4])
    assert block_key(a, [5, 6]) != block_key(b, [5, 6])
    assert block_key(a, [5, 6]) == block_key(block_key(b"", [1, 2]), [5, 6])


def test_a_hit_leaves_the_last_token_to_compute_and_stops_at_the_first_miss():
    cache = PrefixCache(BS)
    cache.publish(1, [1, 2, 3, 4, 5, 6], computed=6)
    assert len(cache.lookup(2, [1, 2, 3, 4, 5, 6])) == 2  # the third block holds the last token
    assert len(cache.lookup(3, [1, 2, 3, 4, 5, 6, 7])) == 3
    assert len(cache.lookup(4, [1, 2, 9, 9, 5, 6, 7])) == 1
    assert cache.lookup(5, [2, 1, 3, 4, 5, 6, 7]) == []


def test_released_blocks_are_evicted_last_block_first_and_least_recently_released_first():
    cache = PrefixCache(BS)
    first = [k for _, k in cache.publish(1, [1, 2, 3, 4], computed=4)]
    second = [k for _, k in cache.publish(2, [5, 6, 7, 8], computed=4)]
    cache.forget(1)
    cache.forget(2)
    assert cache.idle_order() == first[::-1] + second[::-1]
    cache.acquire(3, cache.lookup(3, [1, 2, 3, 4, 0]))  # takes first's blocks back
    cache.forget(3)
    assert cache.evict(2) == second[::-1]
    with pytest.raises(PrefixCacheError, match="asked to evict 3 blocks, only 2 are idle"):
        cache.evict(3)


def test_the_pool_refuses_to_evict_a_block_a_request_holds():
    pool = BlockPool(range(4))
    pool.allocate(1, 1)
    pool.publish(1, 0, b"k")
    with pytest.raises(BlockPoolError, match="evicting block 0, which 1 requests hold"):
        pool.evict(b"k")
    pool.free(1)
    assert (pool.num_allocated, pool.num_idle, pool.num_free) == (0, 1, 3)
    assert pool.evict(b"k") == 0 and pool.num_free == 4


class Model:
    """The scheduler's and the allocator's halves side by side, with what each block holds."""

    def __init__(self) -> None:
        self.cache = PrefixCache(BS)
        self.pool = BlockPool(range(BLOCKS))
        self.contexts: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.holds: dict[int, list[int]] = {}
        """block id -> the tokens whose KV it holds (the context up to its end)."""
        self.released: list[bytes] = []
        """Idle keys in the order they became idle (our own LRU)."""
        self.preempted: dict[int, list[int]] = {}

    def admit(self, rid: int, context: list[int]) -> None:
        if rid in self.contexts:
            return
        # a preempted request comes back with its own context (a context only ever grows)
        context = self.preempted.pop(rid, context)
        hit = self.cache.lookup(rid, context)
        new = -(-len(context) // BS) - len(hit)
        if new + self.cache.idle_count(hit) > self.pool.num_free + self.cache.num_idle:
            # refused: this model may admit the id later with another context, which an engine
            # request never has, so it is forgotten here (the cache memoizes a request's keys)
            self.cache.forget(rid)
            return
        self.cache.acquire(rid, hit)
        self.released = [k for k in self.released if k not in hit]
        blocks = self.pool.attach(rid, hit)
        for i, b in enumerate(blocks):  # the cached blocks hold exactly this context's prefix
            assert self.holds[b] == context[:(i + 1) * BS], "a hit handed out another prefix's KV"
        self.make_room(new)
        for i, b in enumerate(self.pool.allocate(rid, new), start=len(hit)):
            self.holds[b] = context[:(i + 1) * BS]  # computed now
        self.contexts[rid], self.computed[rid] = context, len(context)
        for index, key in self.cache.publish(rid, context, len(context)):
            self.pool.publish(rid, index, key)

    def make_room(self, n: int) -> None:
        short = n - self.pool.num_free
        if short > 0:
            evicted = self.cache.evict(short)
            assert evicted == self.released[:short], "not least recently released first"
            self.released = self.released[short:]
            for k in evicted:
                self.pool.evict(k)

    def let_go(self, rid: int, end: bool) -> None:
        if rid not in self.contexts:
            return
        # its last block first: a prefix's tail is evicted before its head
        freed = [k for k in reversed(self.cache.held(rid)) if self.cache.holders(k) == 1]
        (self.cache.forget if end else self.cache.release)(rid)
        if not end:
            self.preempted[rid] = self.contexts[rid]
        self.released += freed
        self.pool.free(rid)
        del self.contexts[rid], self.computed[rid]

    def check(self) -> None:
        held = {rid: self.cache.held(rid) for rid in self.contexts}
        for k in self.order:
            assert self.cache.holders(k) == sum(k in h for h in held.values())
        assert self.cache.idle_order() == self.released
        assert self.cache.shared_extra == sum(max(self.cache.holders(k) - 1, 0) for k in self.order)
        owned = [b for t in self.pool.owners().values() for b in t]
        assert set(owned).isdisjoint(self.pool._free), "a block in use is on the free stack"
        assert len(set(owned)) + self.pool.num_idle + self.pool.num_free == BLOCKS, "lost a block"
        assert self.pool.num_cached == self.cache.num_cached
        assert self.pool.num_idle == self.cache.num_idle

    @property
    def order(self) -> list[bytes]:
        return list(self.cache._refs)


PIECES = [[1, 2], [3, 4], [5, 6], [1, 2, 7]]
contexts = st.lists(st.sampled_from(range(len(PIECES))), min_size=1, max_size=5).map(
    lambda picks: [t for p in picks for t in PIECES[p]])
ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 5), contexts),
    st.tuples(st.sampled_from(["preempt", "end"]), st.integers(0, 5), st.none())), max_size=40)


@settings(max_examples=slow_scale(1500, 300), deadline=None)
@given(ops)
def test_refcounts_lru_and_no_leaks_over_random_sequences(seq):
    m = Model()
    for op, rid, context in seq:
        if op == "admit":
            m.admit(rid, context)
        else:
            m.let_go(rid, end=op == "end")
        m.check()
    for rid in list(m.contexts):
        m.let_go(rid, end=True)
    m.check()
    assert m.pool.num_allocated == 0 and m.cache.shared_extra == 0
    m.make_room(BLOCKS)  # every idle block can be reclaimed: nothing leaked
    assert m.pool.num_free == BLOCKS and m.cache.num_cached == 0
