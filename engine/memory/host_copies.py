"""Host copies of requests' KV and their reuse (FastSwitch §3.3): which host blocks hold whose KV,
what a swap-out has to copy at all, and what a conversation's next turn can take from its last.

The bookkeeping the scheduler does around the host copy space (`CpuCopyStore`), as one plain
mechanism: no I/O, no messages sent. It queues `SwapOut` orders for the scheduler to put in its
next `RunStep` and counts what reuse saved.

- A request preempted by swap gets a *sole* copy; only the blocks no valid copy holds yet are
  copied (FastSwitch §3.3, "reuse of kept copies").
- Swapped back in, the copy stays as a *backup* when the policy reuses KV, ranked every iteration
  like its owner, so the next swap-out copies only the increment; a more deserving swap-out may
  take (contaminate) the tail of a less deserving backup.
- When a conversation's turn ends, its KV is kept on the host under the conversation's key with
  the tokens it holds; the next turn swaps in the whole blocks of the prefix both turns share
  instead of prefilling them again.
- Any other ending, and every preemption by recompute, drops the request's copy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from engine.iteration_log import SwapCounters
from engine.memory.cpu_store import CpuCopyStore, SwapOutPlan
from engine.messages import SwapOut
from engine.policy import MemorySettings

TURN_ENDS = ("stop", "length", "context", "pool")
"""Finish reasons after which a conversation's KV is worth keeping for its next turn."""


def conversation_key(conversation: str) -> tuple[str, str]:
    """The store key of a conversation's kept KV (request ids are ints: no clash)."""
    return ("conversation", conversation)


class HostCopies:
    def __init__(self, num_blocks: int, block_size: int, *, kv_reuse: bool = False) -> None:
        self.store = CpuCopyStore(range(num_blocks), block_size)
        """The host block space; read it, change it only through this class."""
        self.block_size = block_size
        self.kv_reuse = kv_reuse
        """Keep copies as backups and across turns (the running policy's `kv_reuse`)."""
        self.turn_copies = True
        """With `kv_reuse`, copy an ended turn's KV for the next turn (`turn_copies`)."""
        self.counters = SwapCounters()
        """`reused_blocks`, `turn_prefix_blocks` and `turn_end_blocks_out` since the last take."""
        self._orders: list[SwapOut] = []
        self._backups: set[int] = set()
        """Requests on the device that also have a host copy (re-ranked every iteration)."""
        self._conversations: dict[str, tuple[int, ...]] = {}
        """Tokens of each conversation's last ended turn whose KV is kept on the host."""

    def use(self, memory: MemorySettings) -> None:
        """Follow the running policy's `kv_reuse` and `turn_copies`."""
        self.kv_reuse, self.turn_copies = memory.kv_reuse, memory.turn_copies

    # ------------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        return self.store.num_free

    @property
    def num_total(self) -> int:
        return self.store.num_total

    @property
    def num_copies(self) -> int:
        """Copies held: swapped-out requests, backups, and ended turns kept for reuse."""
        return len(self.store.keys())

    @property
    def kept_blocks(self) -> int:
        """Host blocks holding conversations' ended turns (keys from `conversation_key`)."""
        keys = self.store.keys()  # a list: the store is no dict
        return sum(len(self.store.blocks(k)) for k in keys if isinstance(k, tuple))

    def has_orders(self) -> bool:
        return bool(self._orders)

    def take_orders(self) -> tuple[SwapOut, ...]:
        """The swap-outs ordered since the last take, in the order they were ordered."""
        orders, self._orders = tuple(self._orders), []
        return orders

    def take_counters(self) -> SwapCounters:
        counters, self.counters = self.counters, SwapCounters()
        return counters

    def kept_conversations(self) -> list[str]:
        """Conversations whose last turn's KV is kept (its tokens known)."""
        return list(self._conversations)

    # ------------------------------------------------------------------------ transitions

    def reuse_turn(self, request_id: int, conversation: str, prompt: Sequence[int]) -> int:
        """A conversation's next turn starts from its last turn's copy: the copy becomes the
        request's, cut to the whole blocks of valid tokens both turns share, leaving at least
        one prompt token to compute. Returns the tokens it holds (0: nothing reused, and
        whatever was kept is dropped). FastSwitch §3.3."""
        if not self.kv_reuse:
            return 0
        key = conversation_key(conversation)
        earlier = self._conversations.pop(conversation, None)
        copy = self.store.get(key)
        if copy is None or earlier is None:
            if copy is not None:
                self.store.drop(key)
            return 0
        limit = min(copy.valid_tokens, len(earlier), len(prompt) - 1)
        same = 0
        while same < limit and prompt[same] == earlier[same]:
            same += 1
        keep = same // self.block_size
        if keep == 0:
            self.store.drop(key)
            return 0
        self.store.rekey(key, request_id)
        self.store.keep_prefix(request_id, keep * self.block_size, rank=0.0)
        self.counters.turn_prefix_blocks += keep
        return keep * self.block_size

    def preempt(self, request_id: int, computed_tokens: int, *, rank: float, swap: bool,
                expected_blocks: int | None = None) -> SwapOutPlan | None:
        """The request loses its device blocks. With `swap`, order the copy of what no valid
        copy holds yet and return the plan; None when it is preempted by recompute instead
        (no swap, nothing computed, or no room on the host): its copy is dropped then."""
        self._backups.discard(request_id)
        if swap and computed_tokens:
            plan = self._order_swap_out(request_id, computed_tokens, rank=rank,
                                        expected_blocks=expected_blocks)
            if plan is not None:
                return plan
        self.store.drop(request_id)
        return None

    def swap_in(self, request_id: int, blocks: int, *, valid_tokens: int,
                rank: float) -> tuple[int, ...]:
        """The host blocks holding the request's first `blocks` blocks, to be swapped in. The
        copy stays as a backup valid for `valid_tokens` when KV is reused, else it is dropped."""
        cpu_blocks = tuple(self.store.blocks(request_id)[:blocks])
        if self.kv_reuse:  # the next swap-out copies less
            self.store.mark_backup(request_id, valid_tokens=valid_tokens, rank=rank)
            self._backups.add(request_id)
        else:
            self.store.drop(request_id)
        return cpu_blocks

    @property
    def has_backups(self) -> bool:
        """Some running request's host copy is kept as a backup (`rank_backups` ranks them)."""
        return bool(self._backups)

    def rank_backups(self, rank: Mapping[int, int], unranked: int) -> None:
        """Backups are taken least deserving first: rank them as the policy ranked their owners
        this iteration (`unranked` for owners it left out)."""
        for rid in self._backups:
            self.store.set_rank(rid, rank.get(rid, unranked))

    def end_request(self, request_id: int, reason: str, *, conversation: str | None,
                    blocks: int, computed_tokens: int, prompt: Sequence[int],
                    output: Sequence[int]) -> None:
        """The request ended. A conversation turn that ended well and holds device KV keeps it
        on the host for the next turn (only the part no valid copy holds is copied); any other
        ending drops the request's copy."""
        self._backups.discard(request_id)
        if (self.kv_reuse and self.turn_copies and conversation is not None
                and reason in TURN_ENDS and blocks
                and computed_tokens):
            plan = self._order_swap_out(request_id, computed_tokens, rank=math.inf)
            if plan is not None:
                self.counters.turn_end_blocks_out += len(plan.cpu_blocks)
                self.store.mark_backup(request_id, rank=math.inf)
                self.store.rekey(request_id, conversation_key(conversation))
                self._conversations[conversation] = (*prompt, *output)[:computed_tokens]
                self._forget_lost_conversations()
                return
        self.store.drop(request_id)

    def drop_conversation_copies(self) -> None:
        """A copy of an ended turn failed and which one is unknown: drop every kept turn."""
        for conversation in self._conversations:
            self.store.drop(conversation_key(conversation))
        self._conversations.clear()

    # ------------------------------------------------------------------------ helpers

    def _order_swap_out(self, request_id: int, tokens: int, *, rank: float,
                        expected_blocks: int | None = None) -> SwapOutPlan | None:
        """Make room on the host for the request's first `tokens` tokens and order the copy of
        what no valid copy holds yet; None (nothing ordered) when the host has no room."""
        plan = self.store.prepare_swap_out(request_id, tokens, rank=rank,
                                           expected_blocks=expected_blocks)
        if plan is not None:
            self._orders.append(SwapOut(request_id=request_id, first_block=plan.first_block,
                                        cpu_blocks=plan.cpu_blocks))
            self.counters.reused_blocks += plan.reused_blocks
        return plan

    def _forget_lost_conversations(self) -> None:
        """Drop the tokens of conversations whose copy was taken by others since."""
        if len(self._conversations) > 2 * len(self.store.keys()):
            kept = set(self.store.keys())
            self._conversations = {c: t for c, t in self._conversations.items()
                                   if conversation_key(c) in kept}
