"""One rank of a three-instance data plane for tests/gpu/test_channel_faults.py (a process of
its own: the plane is one per process). `python -m tests.gpu.world_fault_driver RANK PORT`;
rank 0 prints one JSON line of what it saw."""

from __future__ import annotations

import json
import sys
import threading
import time

from gpu.data_plane import CONTROL_TAG, GroupMemberLost, join_data_plane, peer_lost, recv_obj, \
    send_obj

TIMEOUT_S = 4.0
"""Rank 0's world timeout: it goes on well past it."""


def main(rank: int, port: int) -> None:
    plane = join_data_plane(f"tcp://127.0.0.1:{port}", rank, 3,  # (rank 2 waits longer)
                            timeout_s=TIMEOUT_S if rank == 0 else 90.0)
    if rank == 1:  # found silent: it never answers, its process stays (the test ends it)
        time.sleep(120)
        return
    if rank == 2:
        msg = recv_obj(0, CONTROL_TAG, "rank 0's message")
        send_obj(f"re: {msg}", 0, CONTROL_TAG + 2, "the answer")
        time.sleep(30)  # rank 0 reads the answer before this process ends
        return
    out: dict = {}
    threading.Timer(1.0, peer_lost, args=(1,)).start()  # the front door's PeerLost
    began = time.monotonic()
    try:
        recv_obj(1, CONTROL_TAG, "a step's answer was due")  # posted before the loss
    except GroupMemberLost as exc:
        out["lost"] = str(exc)
    out["lost_after_s"] = time.monotonic() - began
    out["left"] = plane.waiter.left
    time.sleep(TIMEOUT_S + 2)  # past the world's timeout: the receive left posted stays quiet
    try:
        send_obj("hello", 2, CONTROL_TAG, "a message to rank 2")
        out["answer"] = recv_obj(2, CONTROL_TAG + 2, "rank 2's answer")
    except GroupMemberLost as exc:
        out["answer_error"] = str(exc)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
