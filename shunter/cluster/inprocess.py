"""The front door's handle on an Engine in its own process (the simulator's N instances on
one virtual clock): the same interface as `RemoteInstance` (shunter/cluster/handles.py)."""

from __future__ import annotations

import math

import anyio
import attrs

from engine.cluster.dispatch import InstanceStats
from engine.errors import EngineDeadError
from engine.messages import Submit
from engine.outputs import Admitted, Rejected
from engine.snapshots import EngineSnapshot
from shunter.cluster.handles import Down, Ended, Redispatch, _live, _Relay
from shunter.cluster.instance import stopped_chunk
from shunter.cluster.wire import summarize
from shunter.engine import Engine


class InProcessInstance(_Relay):
    """An Engine in this process (the simulator's instances share its virtual clock)."""

    def __init__(self, index: int, engine: Engine, *, on_end: Ended,
                 redispatch: Redispatch, on_down: Down) -> None:
        super().__init__(index, on_end, redispatch, on_down)
        self.engine = engine
        self.pid = None
        self._ids: dict[int, int] = {}
        self._cancel_to: dict[int, tuple[Engine, int]] = {}
        """KunServe: requests adopted by a group's head are cancelled there (groups.py)."""
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            await anyio.sleep_forever()

    async def submit(self, key: int, submit: Submit, *, announced: bool = False,
                     since: float | None = None) -> None:
        self._live[key] = _live(submit, announced, since)
        send, recv = anyio.create_memory_object_stream(math.inf)
        own = attrs.evolve(submit, outputs=send)
        try:
            await self.engine._submit(own)
        except EngineDeadError as exc:
            await self._forward(key, Rejected(error=exc))
            return
        self._tg.start_soon(self._relay, key, recv)

    async def _relay(self, key: int, recv) -> None:
        async with recv:
            async for out in recv:
                if isinstance(out, Admitted):
                    self._ids[key] = out.request_id
                await self._forward(key, out)
                if key not in self._live:
                    break
        if key in self._live:  # the engine stopped under the request (an actor failed)
            # (a request moved to a KunServe group's head ends with the head engine's reason)
            engine = self._cancel_to.get(key, (self.engine,))[0]
            reason = engine.stopped_reason()
            admitted = key in self._ids or key in self._cancel_to
            await self._forward(key, stopped_chunk(reason) if admitted
                                else Rejected(error=EngineDeadError(reason)))
        self._ids.pop(key, None)
        self._cancel_to.pop(key, None)

    def cancel_nowait(self, key: int) -> None:
        if key in self._cancel_to:
            engine, rid = self._cancel_to[key]
            engine._cancel_nowait(rid)
        elif key in self._ids:
            self.engine._cancel_nowait(self._ids[key])

    async def snapshot(self) -> EngineSnapshot:
        return await self.engine.inspect()

    async def stats(self) -> InstanceStats:
        return summarize(await self.engine.inspect())

    async def replace_policy(self, text: str) -> None:
        try:
            await self.engine.replace_policy(text)
        except EngineDeadError as exc:
            raise EngineDeadError(f"instance {self.index}: {exc}") from None

    async def close(self, *, detach: bool = False) -> None:
        self._end_live()
