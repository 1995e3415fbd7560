"""The data plane between instance processes: one torch.distributed world (rank = instance
index; gloo on CPU, NCCL on CUDA), the instance's transfer queue (gpu/transfer.py: activations
before KV), and the few typed control messages a pipeline group's head sends its members
(pickled attrs messages as byte tensors; no other link exists between instances).

Tags keep the traffic apart: activations use gpu.pipeline_stage's step/microbatch tags (below
2**28), KV chunks count up from 2**28 per (source, destination), control from 2**29.
"""

from __future__ import annotations

import datetime
import pickle
import socket
from typing import Any

import attrs
import torch
import torch.distributed as dist

from gpu.transfer import TransferQueue

KV_TAG = 1 << 28
CONTROL_TAG = 1 << 29
REPLY_TAG = CONTROL_TAG + 4
WEIGHTS_TAG = CONTROL_TAG + 8


class GroupMemberLost(RuntimeError):
    """A member of the pipeline group stopped answering (its process died or its link broke)."""

    def __init__(self, rank: int, what: str, cause: BaseException) -> None:
        super().__init__(f"pipeline group member instance {rank} was lost while {what}: "
                         f"{type(cause).__name__}: {str(cause)[:200]}")
        self.rank = rank


@attrs.define(eq=False)
class DataPlane:
    rank: int
    world_size: int
    queue: TransferQueue

    def renew_queue(self) -> None:
        """A fresh sending thread (after a failed send killed the old one)."""
        self.queue.close()
        self.queue = TransferQueue()


_plane: DataPlane | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a rendezvous there (`host` "": every interface of
    this machine, where peers on other machines reach it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_data_plane(init_method: str, rank: int, world_size: int, *,
                    timeout_s: float = 60.0, backend: str = "gloo") -> DataPlane:
    """Join the cluster's world (blocks until every instance joined). Once per process."""
    global _plane
    if _plane is not None:
        raise RuntimeError(f"this process already joined the data plane as rank {_plane.rank}")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _plane = DataPlane(rank=rank, world_size=world_size, queue=TransferQueue())
    return _plane


def data_plane() -> DataPlane:
    if _plane is None:
        raise RuntimeError("this instance has not joined the data plane (join_data_plane)")
    return _plane


def leave_data_plane() -> None:
    global _plane
    if _plane is not None:
        _plane.queue.close()
        dist.destroy_process_group()
        _plane = None


def send_obj(obj: Any, dst: int, tag: int, what: str) -> None:
    """Send one pickled message (its length first) to rank `dst`."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                            dtype=torch.uint8)
    try:
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst, tag=tag)
        dist.send(data, dst=dst, tag=tag + 1)
    except RuntimeError as exc:
        raise GroupMemberLost(dst, what, exc) from exc


def recv_obj(src: int, tag: int, what: str) -> Any:
    size = torch.empty(1, dtype=torch.int64)
    try:
        dist.recv(size, src=src, tag=tag)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, src=src, tag=tag + 1)
    except RuntimeError as exc:
        raise GroupMemberLost(src, what, exc) from exc
    return pickle.loads(data.numpy().tobytes())


def recv_tensor(t: torch.Tensor, src: int, tag: int, what: str) -> None:
    try:
        dist.recv(t, src=src, tag=tag)
    except RuntimeError as exc:
        raise GroupMemberLost(src, what, exc) from exc
