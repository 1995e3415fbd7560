"""The scheduler's use of the device prefix cache (engine/memory/prefix_cache.py): which waiting
requests can start from cached blocks, what each step publishes and evicts, and what the
allocator must be told (`PrefixOps` in the next `RunStep`). No I/O, no messages sent.

- Each iteration, waiting requests holding no KV are looked up; their views carry the hit
  (`cached_tokens`) and what taking it costs (`cached_idle_blocks`), and running requests'
  views carry the blocks that would stay in use if they lost theirs (`shared_blocks`), so the
  planner counts memory exactly (engine/planner.py).
- A request admitted with a hit takes the cached blocks and computes only the rest of its
  context; every step's newly filled blocks are published once the step is done (their KV is
  written); blocks filled by a swap-in stay private.
- Preempted or ended requests let go of their blocks; idle cached blocks count as free memory,
  and once a step needs more blocks than are truly free, the least recently used idle ones
  are evicted.
- Turned off (by a policy replacement), nothing is looked up or published, and idle blocks
  are evicted at once; blocks still held are let go as their requests end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from engine.iteration_log import PrefixCacheCounters
from engine.memory.prefix_cache import Key, PrefixCache
from engine.messages import PrefixOps, RunStep
from engine.planner import IterationPlan
from engine.policy import RequestView
from engine.request import Request, views_of


class _Context(Sequence[int]):
    """A request's prompt and output as one sequence, read a block at a time and never
    copied whole (a simulated prompt computes its ids as they are read)."""

    def __init__(self, r: Request) -> None:
        self._prompt, self._output = r.prompt_ids, r.output_ids

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    def __getitem__(self, i):  # type: ignore[override]
        if not isinstance(i, slice):
            n = len(self._prompt)
            return self._prompt[i] if i < n else self._output[i - n]
        start, stop, _ = i.indices(len(self))
        n = len(self._prompt)
        head = list(self._prompt[start:min(stop, n)]) if start < n else []
        return head + list(self._output[max(start - n, 0):max(stop - n, 0)])


def _context(r: Request) -> Sequence[int]:
    return _Context(r) if r.output_ids else r.prompt_ids


class DevicePrefixes:
    def __init__(self, block_size: int, total_blocks: int) -> None:
        self.cache = PrefixCache(block_size)
        self.total_blocks = total_blocks
        self.enabled = False
        self._hits: dict[int, list[Key]] = {}
        self._seen: dict[int, Request] = {}
        """The live requests of the last iteration (their last step's blocks are published at
        the next iteration, including those that ended)."""
        self._publish: list[tuple[int, int, Key]] = []
        self._evict: list[Key] = []
        self._attach: list[tuple[int, tuple[Key, ...]]] = []
        self.totals = PrefixCacheCounters()
        self._since_take = PrefixCacheCounters()

    @property
    def shared_extra(self) -> int:
        """How much the sum of the live requests' blocks overcounts the device blocks in use."""
        return self.cache.shared_extra

    @property
    def pending(self) -> bool:
        """Changes the allocator has not been told yet."""
        return bool(self._publish or self._evict or self._attach)

    def views(self, live: Mapping[int, Request]) -> list[RequestView]:
        """The live requests' views for this iteration, after publishing what the last step
        computed (also for the requests that ended in it)."""
        if self.enabled:
            self._publish_computed(live)
        self._seen = dict(live) if self.enabled else {}
        return self.annotate(views_of(live.values()), live)

    def _publish_computed(self, live: Mapping[int, Request]) -> None:
        """Publish the blocks steps filled since the last call, for the requests live then
        (some may have ended since, still holding their blocks on the allocator until the next
        step releases them, after publishing) and now."""
        for r in {**self._seen, **live}.values():
            if (r.blocks and r.state == "running"
                    and self.cache.publishable(r.id, r.computed_tokens)):
                for index, key in self.cache.publish(r.id, _context(r), r.computed_tokens):
                    self._publish.append((r.id, index, key))

    def annotate(self, views: list[RequestView], live: Mapping[int, Request]) -> list[RequestView]:
        """The views with their cache hits and shared blocks filled in (unchanged when the
        cache is off and holds nothing)."""
        self._sync(live)
        cache, self._hits = self.cache, {}
        idle: dict[int, int] = {}
        wanted: set[Key] = set()  # hit keys a live request holds
        if self.enabled:
            for v in views:
                if v.state == "waiting" and v.computed_tokens == 0 and v.blocks == 0:
                    hit = cache.lookup(v.id, _context(live[v.id]))
                    if hit:
                        self._hits[v.id] = hit
                        idle[v.id] = cache.idle_count(hit, held_into=wanted)
        if not (self._hits or cache.shared_extra):
            return views
        out = []
        for v in views:
            hit = self._hits.get(v.id)
            if hit:
                v = v._replace(cached_tokens=len(hit) * cache.block_size,
                               cached_idle_blocks=idle[v.id])
            elif v.blocks and (shared := cache.shared_blocks(v.id, wanted)):
                v = v._replace(shared_blocks=shared)
            out.append(v)
        return out

    def admit(self, plan: IterationPlan, live: Mapping[int, Request]) -> None:
        """Before the step is built: requests admitted with a hit take their cached blocks and
        start computing after them; swapped-in requests' blocks stay private."""
        bs = self.cache.block_size
        for v in plan.admitted:
            req = live[v.id]
            if v.state == "swapped":
                self.cache.skip(v.id, req.computed_tokens // bs)
                continue
            if not self.enabled or v.computed_tokens or v.blocks or v.id not in plan.work:
                continue
            hit = self._hits.get(v.id, [])
            if hit:
                self.cache.acquire(v.id, hit)
                req.computed_tokens = len(hit) * bs
                req.changed()
                self._attach.append((v.id, tuple(hit)))
            for c in (self.totals, self._since_take):
                c.queried_tokens += v.context_tokens
                c.hit_tokens += len(hit) * bs
                c.queried_blocks += v.context_tokens // bs
                c.hit_blocks += len(hit)
        self._hits = {}

    def _sync(self, live: Mapping[int, Request]) -> None:
        """Requests that ended let go of their blocks and are forgotten; requests preempted
        (holding no blocks now) let go of theirs."""
        cache = self.cache
        for rid in cache.known():
            req = live.get(rid)
            if req is None:
                cache.forget(rid)
            elif req.blocks == 0:
                cache.release(rid)

    def attach_ops(self, step: RunStep, live: Mapping[int, Request]) -> RunStep:
        """After the step's requests took their blocks: evict what the step needs beyond the
        truly free blocks (all idle ones when the cache is off), and put every change since the
        last step into it."""
        self._sync(live)
        cache = self.cache
        if self.enabled:
            used = sum(r.blocks for r in live.values()) - cache.shared_extra
            excess = used + cache.num_idle - self.total_blocks
            evicted = cache.evict(excess) if excess > 0 else []
        else:
            evicted = cache.evict(cache.num_idle)
        self._evict.extend(evicted)
        self.totals.evicted_blocks += len(evicted)
        self._since_take.evicted_blocks += len(evicted)
        if not self.pending:
            return step
        ops = PrefixOps(publish=tuple(self._publish), evict=tuple(self._evict),
                        attach=tuple(self._attach))
        self._publish, self._evict, self._attach = [], [], []
        return attrs.evolve(step, prefix=ops)

    def snapshot(self) -> PrefixCacheCounters:
        """Totals since the engine started."""
        return attrs.evolve(self.totals)

    def take_counters(self) -> PrefixCacheCounters:
        """Counts since the last take."""
        taken, self._since_take = self._since_take, PrefixCacheCounters()
        return taken
