"""Host copies (FastSwitch §3.3): what a swap-out copies, what a backup keeps, what a
conversation's next turn reuses; and a model check, over random histories, that whatever the
mechanism hands back as KV is the KV of the right tokens."""

from __future__ import annotations

import attrs
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.memory.host_copies import TURN_ENDS, HostCopies, conversation_key
from engine.messages import SwapOut
from engine.policy import MemorySettings

BS = 4


def _kept_turn(copies: HostCopies, rid: int, tokens: list[int], conversation: str = "c") -> SwapOut:
    """Request `rid` ran `tokens` on the device and its turn ended: its KV is kept."""
    copies.end_request(rid, "stop", conversation=conversation, blocks=-(-len(tokens) // BS),
                       computed_tokens=len(tokens), prompt=tokens[:-1], output=tokens[-1:])
    (order,) = copies.take_orders()
    return order


def test_a_next_turn_reuses_only_whole_blocks_of_the_prefix_both_turns_share():
    copies = HostCopies(32, BS, kv_reuse=True)
    earlier = list(range(11))
    kept = _kept_turn(copies, 1, earlier)
    assert (kept.request_id, kept.first_block, len(kept.cpu_blocks)) == (1, 0, 3)
    prompt = [*range(9), 99, 100, 101]          # diverges at token 9: blocks 0 and 1 are shared
    assert copies.reuse_turn(2, "c", prompt) == 2 * BS
    assert copies.swap_in(2, 2, valid_tokens=8, rank=0) == kept.cpu_blocks[:2]
    assert copies.counters.turn_prefix_blocks == 2
    assert copies.counters.turn_end_blocks_out == 3
    assert conversation_key("c") not in copies.store.keys()


def test_a_kept_turn_taken_over_from_its_tail_is_reused_only_up_to_what_stayed_valid():
    copies = HostCopies(8, BS, kv_reuse=True)
    kept = _kept_turn(copies, 1, list(range(16)))               # 4 blocks
    plan = copies.preempt(2, 20, rank=0, swap=True)             # 5 blocks: 4 free + 1 taken
    assert plan is not None and kept.cpu_blocks[3] in plan.cpu_blocks
    assert copies.store.get(conversation_key("c")).contaminated
    assert copies.reuse_turn(3, "c", list(range(20))) == 3 * BS
    assert copies.swap_in(3, 3, valid_tokens=12, rank=0) == kept.cpu_blocks[:3]


def test_an_identical_prompt_still_leaves_a_token_to_compute():
    copies = HostCopies(32, BS, kv_reuse=True)
    _kept_turn(copies, 1, list(range(12)))
    # 12 shared tokens, but the last prompt token must be computed to sample: 11 -> 2 blocks
    assert copies.reuse_turn(2, "c", list(range(12))) == 2 * BS


def test_a_turn_that_shares_no_whole_block_drops_what_was_kept():
    copies = HostCopies(32, BS, kv_reuse=True)
    _kept_turn(copies, 1, list(range(12)))
    assert copies.reuse_turn(2, "c", [0, 1, 2, 7, 8, 9]) == 0
    assert copies.num_copies == 0 and copies.num_free == 32
    assert copies.reuse_turn(3, "c", list(range(12))) == 0  # nothing left to reuse


def test_only_turns_that_end_well_and_hold_kv_are_kept():
    copies = HostCopies(32, BS, kv_reuse=True)
    for rid, (reason, blocks) in enumerate([("cancelled", 3), ("error", 3), ("stop", 0)]):
        copies.end_request(rid, reason, conversation="c", blocks=blocks, computed_tokens=10,
                           prompt=list(range(10)), output=[])
    assert copies.take_orders() == () and copies.num_copies == 0
    copies.end_request(9, "length", conversation=None, blocks=3, computed_tokens=10,
                       prompt=list(range(10)), output=[])
    assert copies.take_orders() == () and copies.num_copies == 0


def test_with_turn_copies_off_an_ended_turn_is_not_copied_but_preemptions_still_reuse():
    """Issue 13 item 7: `memory { turn_copies off }` keeps FastSwitch §3.3's reuse of preemption
    copies but no longer copies every ended turn to the host."""
    copies = HostCopies(32, BS, kv_reuse=True)
    copies.use(MemorySettings(kv_reuse=True, turn_copies=False))
    copies.end_request(1, "stop", conversation="c", blocks=3, computed_tokens=10,
                       prompt=list(range(9)), output=[9])
    assert copies.take_orders() == () and copies.num_copies == 0
    assert copies.take_counters().turn_end_blocks_out == 0
    assert copies.reuse_turn(2, "c", list(range(14))) == 0
    first = copies.preempt(2, 8, rank=0.0, swap=True)          # a preemption copy...
    copies.swap_in(2, 2, valid_tokens=8, rank=0.0)              # ...kept as a backup
    again = copies.preempt(2, 12, rank=0.0, swap=True)
    assert len(first.cpu_blocks) == 2 and (again.first_block, again.reused_blocks) == (2, 2)


def test_without_kv_reuse_no_copy_outlives_its_swap_in_or_its_turn():
    copies = HostCopies(32, BS, kv_reuse=False)
    plan = copies.preempt(1, 10, rank=0, swap=True)
    assert plan is not None and copies.take_orders()[0].cpu_blocks == plan.cpu_blocks
    assert copies.swap_in(1, 3, valid_tokens=10, rank=0) == plan.cpu_blocks
    assert copies.num_copies == 0
    copies.end_request(2, "stop", conversation="c", blocks=3, computed_tokens=10,
                       prompt=list(range(10)), output=[])
    assert copies.take_orders() == () and copies.reuse_turn(3, "c", list(range(10))) == 0


def test_a_second_swap_out_copies_only_what_the_backup_lacks():
    copies = HostCopies(32, BS, kv_reuse=True)
    copies.preempt(1, 10, rank=0, swap=True)
    copies.swap_in(1, 3, valid_tokens=10, rank=0)   # the copy stays as a backup
    plan = copies.preempt(1, 22, rank=0, swap=True)
    # blocks 0 and 1 are full and valid; block 2 held tokens 8..9 only, so it is copied again
    assert (plan.first_block, len(plan.cpu_blocks), plan.reused_blocks) == (2, 4, 2)
    assert [o.first_block for o in copies.take_orders()] == [0, 2]
    assert copies.counters.reused_blocks == 2


def test_recompute_drops_the_copy_and_a_full_host_means_recompute():
    copies = HostCopies(4, BS, kv_reuse=True)
    copies.preempt(1, 8, rank=0, swap=True)
    copies.swap_in(1, 2, valid_tokens=8, rank=0)
    assert copies.preempt(1, 8, rank=0, swap=False) is None
    assert copies.store.get(1) is None
    copies.take_orders()
    copies.preempt(2, 16, rank=0, swap=True)        # the whole host, sole: never taken
    assert copies.preempt(3, 4, rank=1, swap=True) is None
    assert copies.store.get(3) is None and [o.request_id for o in copies.take_orders()] == [2]


def test_a_copy_failure_drops_every_kept_turn_and_nothing_else():
    copies = HostCopies(32, BS, kv_reuse=True)
    _kept_turn(copies, 1, list(range(8)), conversation="a")
    _kept_turn(copies, 2, list(range(8)), conversation="b")
    copies.preempt(3, 8, rank=0, swap=True)
    copies.drop_conversation_copies()
    assert copies.store.keys() == [3] and copies.kept_conversations() == []
    assert copies.reuse_turn(4, "a", list(range(9))) == 0


def test_take_orders_and_counters_start_afresh():
    copies = HostCopies(32, BS, kv_reuse=True)
    _kept_turn(copies, 1, list(range(8)))
    copies.reuse_turn(2, "c", list(range(9)))
    assert copies.take_counters().turn_prefix_blocks == 2
    assert copies.take_counters().turn_prefix_blocks == 0 and not copies.has_orders()


# ------------------------------------------------------------------------------ model check


@attrs.define
class Live:
    tokens: list[int]
    prompt: int
    """Prompt length: tokens past it are outputs."""
    conversation: str | None
    computed: int = 0
    swapped_blocks: int = 0
    """> 0 while swapped out (its KV on the host only)."""


@attrs.define
class World:
    """What the engine around the mechanism holds, and what the host blocks really contain."""

    copies: HostCopies
    live: dict[int, Live] = attrs.field(factory=dict)
    host: dict[int, tuple[int, ...]] = attrs.field(factory=dict)
    """host block -> the tokens whose KV the copies ordered so far wrote there."""
    kept: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    """conversation -> the tokens of the turn whose KV the mechanism kept."""
    ended: dict[int, Live] = attrs.field(factory=dict)
    reused: int = 0
    prefix_blocks: int = 0
    turn_end_blocks: int = 0
    next_id: int = 1

    def execute_orders(self, turn_end: int | None = None) -> None:
        """Carry out the swap-outs ordered, as the swap pool would, in order."""
        for o in self.copies.take_orders():
            r = self.live.get(o.request_id) or self.ended[o.request_id]
            assert o.first_block + len(o.cpu_blocks) == -(-r.computed // BS), "copies to the end"
            for i, blk in enumerate(o.cpu_blocks, start=o.first_block):
                self.host[blk] = tuple(r.tokens[i * BS:min((i + 1) * BS, r.computed)])
            self.reused += o.first_block
            if o.request_id == turn_end:
                self.turn_end_blocks += len(o.cpu_blocks)
                self.kept[r.conversation] = tuple(r.tokens[:r.computed])
        self.ended.clear()


def new(w: World, n: int, rank: int, flag: bool, variant: int) -> None:
    rid, w.next_id = w.next_id, w.next_id + 1
    conversation = f"c{n % 2}" if flag else None
    earlier = list(w.kept.get(conversation, ()))
    prompt = [200 + rid, 300 + rid]
    if variant == 0:                       # continue the conversation
        prompt = earlier + prompt
    elif variant == 1 and earlier:        # change one token of it
        earlier[n % len(earlier)] += 1000
        prompt = earlier + prompt
    r = w.live[rid] = Live(tokens=prompt, prompt=len(prompt), conversation=conversation)
    if conversation is None:
        return
    before = w.kept.pop(conversation, ())
    k = w.copies.reuse_turn(rid, conversation, prompt)
    assert k % BS == 0 and k < len(prompt), "whole blocks, and a token left to compute"
    assert prompt[:k] == list(before[:k]), "only tokens both turns share"
    if k:
        r.computed, r.swapped_blocks = k, k // BS
        w.prefix_blocks += k // BS


def compute(w: World, rid: int, n: int) -> None:
    r = w.live[rid]
    r.computed += n
    r.tokens.extend(1000 * rid + i for i in range(len(r.tokens), r.computed + 1))


def preempt(w: World, rid: int, rank: int, swap: bool) -> None:
    r = w.live[rid]
    plan = w.copies.preempt(rid, r.computed, rank=rank, swap=swap)
    if plan is None:
        assert w.copies.store.get(rid) is None, "a copy outlived its recompute preemption"
        r.computed = 0
    else:
        r.swapped_blocks = -(-r.computed // BS)


def swap_in(w: World, rid: int, rank: int) -> None:
    r = w.live[rid]
    blocks = w.copies.swap_in(rid, r.swapped_blocks, valid_tokens=r.computed, rank=rank)
    assert len(blocks) == r.swapped_blocks
    for i, blk in enumerate(blocks):
        want = tuple(r.tokens[i * BS:min((i + 1) * BS, r.computed)])
        assert w.host.get(blk) == want, f"request {rid} swaps in stale KV at block {i}"
    r.swapped_blocks = 0


def end(w: World, rid: int, n: int) -> None:
    r = w.ended[rid] = w.live.pop(rid)
    reason = (*TURN_ENDS, *TURN_ENDS, "cancelled", "error")[n % 6]
    blocks = 0 if r.swapped_blocks else -(-r.computed // BS)
    w.copies.end_request(rid, reason, conversation=r.conversation, blocks=blocks,
                         computed_tokens=r.computed, prompt=r.tokens[:r.prompt],
                         output=r.tokens[r.prompt:])
    assert w.copies.store.get(rid) is None


def check(w: World) -> None:
    store, owned = w.copies.store, []
    for key in store.keys():
        blocks, copy = store.blocks(key), store.get(key)
        owned.extend(blocks)
        if isinstance(key, tuple):
            tokens = w.kept[key[1]]
        else:
            tokens = w.live[key].tokens
        for i in range(copy.valid_tokens // BS):
            assert w.host.get(blocks[i]) == tuple(tokens[i * BS:(i + 1) * BS]), f"{key} stale"
    for rid, r in w.live.items():
        if r.swapped_blocks:  # a swapped request's copy is sole: never taken, never shortened
            copy = store.get(rid)
            assert copy is not None and copy.sole and copy.valid_tokens == r.computed
            assert len(store.blocks(rid)) >= r.swapped_blocks
    assert len(owned) == len(set(owned)), "a host block owned twice"
    assert len(owned) + w.copies.num_free == w.copies.num_total
    c = w.copies.counters
    assert (c.reused_blocks, c.turn_prefix_blocks, c.turn_end_blocks_out) == \
        (w.reused, w.prefix_blocks, w.turn_end_blocks)


OPS = ("new", "new", "compute", "compute", "compute", "preempt", "preempt", "swap_in",
       "swap_in", "end", "end", "fail", "rank")
ops = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 7), st.integers(1, 12),
                         st.integers(0, 5), st.booleans(), st.integers(0, 2)),
               min_size=20, max_size=80)


TAKEN_OVER_TURN = [  # a kept turn loses two blocks to a swap-out, then its next turn arrives
    ("new", 0, 2, 0, True, 0), ("compute", 0, 12, 0, False, 0), ("end", 0, 0, 0, False, 0),
    ("new", 0, 1, 0, False, 0), ("compute", 0, 12, 0, False, 0), ("preempt", 0, 1, 0, True, 0),
    ("new", 0, 2, 0, True, 0), ("swap_in", 0, 1, 0, False, 0)]


@settings(max_examples=400, deadline=None)
@example(TAKEN_OVER_TURN, True, 4)
@given(ops, st.booleans(), st.integers(4, 16))
def test_host_copies_never_hand_back_stale_or_foreign_kv(seq, kv_reuse, host_blocks):
    """Random histories of arrivals (continuing, changing or leaving a conversation), compute,
    preemption by swap or recompute, swap-ins, endings, copy failures and re-ranking."""
    w = World(copies=HostCopies(host_blocks, BS, kv_reuse=kv_reuse))
    for op, pick, n, rank, flag, variant in seq:
        ids = sorted(w.live)
        on_device = [i for i in ids if not w.live[i].swapped_blocks]
        swapped = [i for i in ids if w.live[i].swapped_blocks]
        turn_end = None
        if op == "new":
            new(w, n, rank, flag, variant)
        elif op == "compute" and on_device:
            compute(w, on_device[pick % len(on_device)], n)
        elif op == "preempt" and on_device:
            preempt(w, on_device[pick % len(on_device)], rank, flag)
        elif op == "swap_in" and swapped:
            swap_in(w, swapped[pick % len(swapped)], rank)
        elif op == "end" and ids:
            turn_end = ids[pick % len(ids)]
            end(w, turn_end, n)
        elif op == "fail":
            w.copies.drop_conversation_copies()
            w.kept.clear()
            assert not any(isinstance(k, tuple) for k in w.copies.store.keys())
        elif op == "rank":
            w.copies.rank_backups({i: (i * rank) % 7 for i in ids}, unranked=7)
        w.execute_orders(turn_end)
        check(w)
    if not kv_reuse:
        assert all(not isinstance(k, tuple) for k in w.copies.store.keys())
        assert w.copies.counters.turn_prefix_blocks == 0
