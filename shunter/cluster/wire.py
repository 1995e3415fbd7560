"""The control link between the front door and one instance process: typed attrs messages,
pickled and length-prefixed over one TCP connection (loopback for local instances; the Ray
node's address across machines). Tensors never travel here: activations and KV go over
torch.distributed (gpu/transfer.py). Pickle trusts the peer: run a cluster on a trusted
network only, as Ray itself requires."""

from __future__ import annotations

import pickle
import struct
from typing import Any

import anyio
import attrs
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

from engine.cluster.dispatch import InstanceStats
from engine.messages import ClientOutput
from engine.params import SamplingParams, SchedulingParams
from engine.snapshots import EngineSnapshot

_HEADER = struct.Struct("!I")


# ---------------------------------------------------------------- front door -> instance

@attrs.frozen(kw_only=True)
class SubmitRequest:
    key: int
    """The cluster's request id; every answer about this request carries it."""
    prompt: str | None
    prompt_ids: tuple[int, ...] | None
    sampling: SamplingParams
    scheduling: SchedulingParams
    stream: bool = True


@attrs.frozen(kw_only=True)
class CancelRequest:
    key: int


@attrs.frozen(kw_only=True)
class AskSnapshot:
    key: int


@attrs.frozen(kw_only=True)
class AskStats:
    """The monitor's question: the summary the coordinator reads, not the whole snapshot."""

    key: int


@attrs.frozen(kw_only=True)
class ReplacePolicyText:
    key: int
    text: str


@attrs.frozen(kw_only=True)
class Shutdown:
    """Stop the engine and end the process."""


@attrs.frozen(kw_only=True)
class Detach:
    """This front door is done; keep serving and wait for the next one (a front door that
    attached to running instances, such as the tests' shared ones)."""


@attrs.frozen(kw_only=True)
class Ping:
    """Are you there? (shunter/cluster/heartbeat.py); answered by `Pong` with the same seq."""

    seq: int


@attrs.frozen(kw_only=True)
class PeerLost:
    """The front door declared instance `index` lost without its link closing (it went
    silent): the data plane's watch counts it gone (gpu/data_plane.py `peer_lost`)."""

    index: int


ToInstance = (SubmitRequest | CancelRequest | AskSnapshot | AskStats | ReplacePolicyText
              | Shutdown | Detach | Ping | PeerLost)


# ---------------------------------------------------------------- instance -> front door

@attrs.frozen(kw_only=True)
class Output:
    key: int
    output: ClientOutput
    """Admitted (the instance's own id), Rejected, or a GenerationChunk."""


@attrs.frozen(kw_only=True)
class Snapshot:
    key: int
    snapshot: EngineSnapshot | None
    error: str | None = None


@attrs.frozen(kw_only=True)
class Stats:
    key: int
    stats: InstanceStats | None
    error: str | None = None


@attrs.frozen(kw_only=True)
class PolicyReplaced:
    key: int
    error: str | None = None
    engine_stopped: bool = False
    """The instance's engine had stopped: the error is its, not the policy's."""


@attrs.frozen(kw_only=True)
class Hello:
    """The instance's first message once its engine serves."""

    pid: int
    block_size: int
    vocab_size: int
    policy_source: str


@attrs.frozen(kw_only=True)
class Pong:
    """The answer to `Ping`, sent by the task that reads the link (never the device thread)."""

    seq: int


FromInstance = Output | Snapshot | Stats | PolicyReplaced | Hello | Pong


def summarize(snap: EngineSnapshot) -> InstanceStats:
    s = snap.scheduler
    return InstanceStats(waiting=s.waiting, running=s.running, swapped=s.swapped,
                         free_blocks=s.free_blocks, total_blocks=s.total_blocks,
                         preemptions=s.preemptions, iteration_ms=s.iteration_ms,
                         queued_tokens=s.queued_tokens, head_tokens=s.head_tokens,
                         pending_tokens=s.pending_tokens)


class Link:
    """Framed messages over one byte stream; sends are serialised by a lock."""

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._recv = BufferedByteReceiveStream(stream)
        self._lock = anyio.Lock()

    async def send(self, msg: Any) -> None:
        """Send one message whole: a sender cancelled once its frame has started (trio writes
        a socket in parts, with checkpoints between) still finishes the frame, else the peer
        would read the next message's bytes as the rest of this one."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        async with self._lock:
            with anyio.CancelScope(shield=True):
                await self._stream.send(_HEADER.pack(len(data)) + data)

    async def receive(self) -> Any:
        """The next message; raises anyio.EndOfStream (or a broken-resource error) when the
        peer has gone."""
        (size,) = _HEADER.unpack(await self._recv.receive_exactly(_HEADER.size))
        return pickle.loads(await self._recv.receive_exactly(size))

    async def aclose(self) -> None:
        await self._stream.aclose()
