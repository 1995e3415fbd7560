"""The one OS thread that runs every torch call of a runner.

Why one thread, and why it matters on CPU: torch's CPU kernels parallelise through OpenMP, and
libgomp keeps a separate pool of helper threads for every thread that ever enters a parallel
region. Once the helpers of all pools outnumber the cores, libgomp stops spinning between
regions, and each of a step's hundreds of small parallel regions then pays a sleep and a wake-up.
Measured on a 2-core machine: a decode step of the shipped model at batch 64 took 36 ms instead
of 18 ms once one `torch.zeros` had run on the event loop's thread, and the engine's output rate
halved. So the runner loads the model, allocates the swap space and runs every step here; the
swap workers copy single-threaded (`gpu.swap`); the event loop's thread runs no torch at all.

An application that itself ran torch on its main thread before starting the engine has made a
pool there already; the engine still works, at the slower rate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread

try:
    from anyio.lowlevel import current_token
except ImportError:  # anyio < 4.11: wait for the future on one of anyio's worker threads
    current_token = None

T = TypeVar("T")


class DeviceThread:
    """Runs callables one at a time, in submission order, on a single long-lived thread (made
    on first use, and made again after `close`, so a runner can serve one engine after another)."""

    def __init__(self, name: str = "shunter-device") -> None:
        self._name = name
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        return self._pool.submit(fn, *args)

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn` there and block until it returns (for callers outside an event loop)."""
        return self.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn` there without blocking the event loop; returns or raises what `fn` did.

        Like `anyio.to_thread.run_sync`, the wait is shielded: a cancelled caller still waits
        for the call to finish, so the runner's state never changes behind the caller's back.
        """
        if current_token is None:
            return await anyio.to_thread.run_sync(self.submit(fn, *args).result)
        token = current_token()
        loop_thread = threading.get_ident()
        done = anyio.Event()

        def wake(_: Future[T]) -> None:
            if threading.get_ident() == loop_thread:  # finished before the callback was added
                done.set()
                return
            try:
                anyio.from_thread.run_sync(done.set, token=token)
            except RuntimeError:  # the event loop has ended; nobody waits any more
                pass

        future = self.submit(fn, *args)
        future.add_done_callback(wake)
        with anyio.CancelScope(shield=True):
            await done.wait()
        return future.result()

    def close(self) -> None:
        """Finish what was submitted, then end the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def call_on_own_thread(fn: Callable[..., T], *args: object) -> T:
    """Run `fn` on a thread that ends with it, so the OpenMP pool it makes ends too (for work
    outside an engine, like the profiler's, in a process that starts an engine afterwards)."""
    thread = DeviceThread()
    try:
        return thread.call(fn, *args)
    finally:
        thread.close()
