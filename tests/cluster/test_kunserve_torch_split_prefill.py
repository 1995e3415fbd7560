"""A torch pipeline group's lookahead cut that divides prompts between microbatches, for certain,
whatever the machine's load: the head (a real `KunServeTorchRunner` leading through
gpu/group_runner.py) and its member (a second real runner in the real `serve_member` loop,
gpu/group_member.py, on a thread) run the tiny 4-layer model split 2 + 2, and every request
gives transformers' greedy tokens.

The cluster burst test (test_kunserve_torch_cluster.py) cuts by the Eq. 1-3 fit of measured
microbatch times, so whether a prefill is divided there depends on the load; here the head's
`StageFits` never gets enough samples to fit (`min_samples` out of reach), so every cut balances
tokens (`TOKEN_COUNT`, engine/cluster/stage_fits.py `StageFits.cut`): a long prompt beside a
few decodes is cut into several pieces, and each later piece runs in a later microbatch against
the KV its earlier pieces wrote; the decodes beside them are of requests the head started
alone, whose KV for the member's layers was exchanged as the group formed. Stand-ins: the data
plane only (a mailbox per (source, tag) in place of gloo between the two threads: with two
members a message's source names its destination).

Planted bugs checked by hand in stage_fits.pieces (/work/notes/lookahead_split_test.md): every
piece of a cut prompt starting at its first token (`L3: step 0: engine 173, reference 172`); a
microbatch dropping its last sequence (the head: `step 3 sampled no token for requests [2]`);
a microbatch dropping a piece that does not end its prompt, beside another request's work (no
token missing, its KV is: `L5: step 1: engine 53, reference 7`).
"""

from __future__ import annotations

import pickle
import queue
import random
import threading
from collections import defaultdict

from tests.reference import assert_matches, greedy_reference

SOLO_BLOCKS = 24
BLOCK = 4
WAIT_S = 60.0
"""A receive that waits longer than this fails the test (a message never sent: a hang)."""


class Mailbox:
    """gloo between two threads: messages and tensors from rank `src` under `tag`, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict[tuple[int, int], queue.Queue] = defaultdict(queue.Queue)

    def _box(self, src: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._boxes[(src, tag)]

    def _take(self, src: int, tag: int, what: str):
        from gpu.data_plane import GroupMemberLost

        try:
            return self._box(src, tag).get(timeout=WAIT_S)
        except queue.Empty as exc:
            raise GroupMemberLost(src, what, TimeoutError(f"nothing under tag {tag}")) from exc

    def send_obj(self, obj, dst: int, tag: int, what: str) -> None:
        self._box(1 - dst, tag).put(pickle.dumps(obj))  # pickled, as the data plane sends it

    def recv_obj(self, src: int, tag: int, what: str):
        return pickle.loads(self._take(src, tag, what))

    def send_tensor(self, tensor, dst: int, tag: int) -> None:  # a TransferQueue's sender
        self._box(1 - dst, tag).put(tensor.detach().clone())

    def recv_tensor(self, t, src: int, tag: int, what: str) -> None:
        got = self._take(src, tag, what)
        if got.shape != t.shape:
            raise AssertionError(f"tag {tag} from {src}: sent {tuple(got.shape)}, "
                                 f"received into {tuple(t.shape)}")
        t.copy_(got)


def _runner(model_dir):
    from engine.config import EngineConfig
    from shunter.backends import build_backend

    runner = build_backend(EngineConfig(model=model_dir, device="cpu", threads=1,
                                        num_blocks=SOLO_BLOCKS, block_size=BLOCK,
                                        cpu_swap_blocks=0)).runner
    return runner, runner._load()


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 320) for _ in range(n)]


def test_lookahead_cuts_prompts_between_microbatches_with_transformers_outputs(
        monkeypatch, kunserve_model):
    """Three short requests run two steps on the head alone, then the group forms (their KV
    for layers 2-3 goes to the member) and they decode while two long prompts arrive, one
    after the other (the second with a short one); each long prompt's step is cut by tokens
    into 4 microbatches (2 x the members), the prompt's chunk divided between at least two of
    them, its later pieces starting past its first token, and a piece that does not end its
    prompt shares a microbatch with another request's work. Every request's greedy tokens
    equal transformers'; the group then restores and the member leaves its loop with no
    sequence."""
    import gpu.group_member as gm
    import gpu.group_runner as gr
    import gpu.group_stage as gs
    from engine.cluster.drop_plan import GroupPlan
    from engine.cluster.stage_fits import StageFits
    from gpu.data_plane import Channel, DataPlane
    from tests.gpu.kunserve_driver import Req, Scheduler

    box = Mailbox()
    planes = [DataPlane(rank=r, world_size=2) for r in range(2)]
    channels: list = []

    def open_channel(plane, key, ranks):  # the group's channel: the mailbox as well
        channels.append(Channel(ranks, plane.rank, box.send_tensor,
                                lambda t, src, tag: box.recv_tensor(t, src, tag, "")))
        return channels[-1]

    for mod in (gr, gm):
        monkeypatch.setattr(mod, "send_obj", box.send_obj)
        monkeypatch.setattr(mod, "recv_obj", box.recv_obj)
    monkeypatch.setattr(gs, "open_channel", open_channel)
    monkeypatch.setattr(gr, "data_plane", lambda: planes[0])
    monkeypatch.setattr(gm, "data_plane", lambda: planes[1])

    (head, solo_ids), (member, _) = _runner(kunserve_model), _runner(kunserve_model)
    served: list = []

    def serve() -> None:
        try:
            served.append(gm.serve_member(member, 0))
        except BaseException as exc:  # noqa: BLE001 (the test reports it)
            served.append(exc)

    thread = threading.Thread(target=serve, daemon=True, name="group-member-1")
    try:
        thread.start()
        plan = GroupPlan(group_id=1, members=(0, 1), layers=(range(2), range(2, 4)))
        fits = StageFits(2, min_samples=10**9)  # never fitted: every cut balances tokens
        head.stage_fits[((0, 2), (2, 4))] = fits
        head.microbatch = "lookahead"

        rng = random.Random(3)
        sched = Scheduler(solo_ids, BLOCK)
        # before step k: (kind, prompt tokens, max tokens) of each request arriving
        arrive = {0: [("S", 6, 8)] * 3, 2: [("L", 37, 4)], 4: [("S", 5, 4), ("L", 29, 4)]}
        reqs: list = []
        cuts = {}  # long request id -> (its index in the step, the cut of its prompt's step)
        while sched.live() or sched.step_id <= max(arrive):
            if sched.step_id == 2:  # the short requests' KV goes to the member's layers
                pool, own = head.form(plan, ())
                assert own == (0, 1, 2) and head.group.fits is fits, own
                assert head.group.microbatches == 4
                sched.grow(pool)
            for kind, n, most in arrive.get(sched.step_id, ()):
                reqs.append(Req(f"{kind}{len(reqs)}", _prompt(rng, n), most, rid=len(reqs)))
                sched.add(reqs[-1])
            step = sched.next_step()
            done = head.execute(step)
            sched.finish(step, done.sampled)
            for i, w in enumerate(step.seqs):
                if reqs[w.request_id].name[0] == "L" and w.start == 0:
                    cuts[w.request_id] = (i, head.group.last_cut)
        shared = 0  # pieces of a cut prompt that do not end it, beside another sequence
        for rid, (i, cut) in cuts.items():
            mine = [[(s, n) for j, s, n in mb if j == i] for mb in cut]
            starts = [p[0][0] for p in mine if p]
            assert len(cut) == 4 and len(starts) >= 2 and starts[0] == 0, (rid, cut)
            assert sum(n for p in mine for _, n in p) == len(reqs[rid].prompt), (rid, cut)
            shared += sum(len(mb) > 1 and bool(p) and p[-1][0] + p[-1][1] < len(reqs[rid].prompt)
                          for mb, p in zip(cut, mine))
        assert len(cuts) == 2 and shared >= 1, cuts
        assert fits.split_chunks >= 2 and fits.cuts == 0, fits.report()

        for r in reqs:
            assert_matches(r.out, greedy_reference(kunserve_model, r.prompt, r.max_tokens),
                           r.name)
        assert head.dissolve_idle()
        thread.join(timeout=WAIT_S)
        assert not thread.is_alive() and len(served) == 1, served
        assert isinstance(served[0], dict) and "abandoned" not in served[0], served
        assert served[0]["chunks_received"] >= 3 and served[0]["received_bytes"] > 0, served
        assert member._seqs == {} and head.group is None
    finally:
        if thread.is_alive():  # the test failed with the member waiting: let it go
            box.send_obj(gs.GroupAbandon(lost=-1, why="the test ended"), 1, gr.CONTROL_TAG, "")
            thread.join(timeout=WAIT_S)
        head.close()
        member.close()
        for c in channels:
            c.queue.close()
