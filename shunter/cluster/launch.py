"""Starting instance processes: on this machine (`local`: multiprocessing, no extra dependency)
or wherever Ray places them (`ray`: the `cluster` extra). Either way the instance serves one
control link (shunter/cluster/instance.py), and the front door connects to it."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import attrs

from engine.config import EngineConfig
from engine.errors import ConfigError
from shunter.cluster.instance import instance_process, serve_instance

START_TIMEOUT_S = 300.0
"""How long an instance may take to load its model and listen."""


@attrs.frozen(kw_only=True)
class Launched:
    host: str
    port: int
    describe_death: Callable[[], str]
    """Says why the instance's process ended (called once its link closed)."""
    kill: Callable[[], None]
    pid: int
    node: str = ""
    """The Ray node it runs on, or the network namespace of a local process ("": this
    machine's)."""


class Launcher(Protocol):
    async def launch(self, index: int, config: EngineConfig) -> Launched: ...

    def shutdown(self) -> None: ...


class LocalLauncher:
    """Instances as child processes of this one (spawned: a fresh interpreter each), listening
    on loopback; or, with `hosts`, instance i in the network namespace `hosts[i][0]` (a host of
    its own on this machine: tests/cluster/netns.py), listening on its address `hosts[i][1]`."""

    def __init__(self, async_backend: str = "asyncio", *,
                 hosts: Sequence[tuple[str, str]] = ()) -> None:
        self._ctx = mp.get_context("spawn")
        self._async_backend = async_backend
        self._hosts = list(hosts)
        self._procs: list[mp.Process] = []

    async def launch(self, index: int, config: EngineConfig) -> Launched:
        return await anyio.to_thread.run_sync(self.start_process, index, config)

    def start_process(self, index: int, config: EngineConfig) -> Launched:
        """Start one instance process and wait until it listens (blocking)."""
        if self._hosts and index >= len(self._hosts):
            raise ConfigError(f"instance {index}: the launcher has {len(self._hosts)} hosts")
        netns, host = self._hosts[index] if self._hosts else ("", "127.0.0.1")
        parent, child = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=instance_process, name=f"shunter-instance-{index}",
                                 args=(config, host, child, self._async_backend, netns))
        proc.start()
        child.close()
        self._procs.append(proc)

        def wait_port():
            if not parent.poll(START_TIMEOUT_S):
                return f"did not start within {START_TIMEOUT_S:.0f} s"
            try:
                return parent.recv()
            except EOFError:
                proc.join(timeout=5)
                return f"its process ended while starting (exit code {proc.exitcode})"

        port = wait_port()
        if not isinstance(port, int):
            proc.kill()
            raise ConfigError(f"instance {index} failed to start: {port}")

        def describe_death() -> str:
            proc.join(timeout=5)
            code = proc.exitcode
            how = (f"killed by signal {-code}" if code is not None and code < 0
                   else f"exit code {code}" if code is not None else "still running")
            return f"instance {index} (pid {proc.pid}) went away ({how})"

        def kill() -> None:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)

        return Launched(host=host, port=port, describe_death=describe_death, kill=kill,
                        pid=proc.pid, node=netns)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Wait for the instances told to shut down; kill what is left after `timeout_s`."""
        for proc in self._procs:
            proc.join(timeout=timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


class RayLauncher:
    """Instances as Ray actors, one CPU (or GPU) each, placed by Ray on the cluster it is
    connected to (`ray.init(address=...)` before, or a local one started here). Ray restarts
    nothing: a dead instance stays dead and the coordinator serves with the rest."""

    def __init__(self, *, num_gpus: float = 0.0) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError("--cluster ray needs Ray: pip install 'shunter[cluster]'") from None
        self._ray = ray
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            if address:  # an existing Ray cluster: its own settings (and dashboard) apply
                ray.init(address=address, log_to_driver=False)
            else:  # a local Ray for this process only
                ray.init(log_to_driver=False)
        self._actor_cls = ray.remote(num_cpus=1, num_gpus=num_gpus, max_restarts=0)(RayInstance)
        self._actors: list = []

    async def launch(self, index: int, config: EngineConfig) -> Launched:
        return await anyio.to_thread.run_sync(self.start_actor, index, config)

    def start_actor(self, index: int, config: EngineConfig) -> Launched:
        """Create one instance actor and wait until it listens (blocking)."""
        ray = self._ray
        actor = self._actor_cls.options(name=f"shunter-instance-{index}-{os.getpid()}").remote()
        self._actors.append(actor)
        try:
            host, port, pid, node = ray.get(actor.start.remote(config),
                                            timeout=START_TIMEOUT_S)
        except Exception as exc:
            raise ConfigError(f"instance {index} failed to start on Ray: {exc}") from None

        def describe_death() -> str:
            return f"instance {index} (Ray actor, pid {pid} on {host}, node {node}) went away"

        def kill() -> None:
            ray.kill(actor, no_restart=True)

        return Launched(host=host, port=port, describe_death=describe_death, kill=kill, pid=pid,
                        node=node)

    def shutdown(self) -> None:
        for actor in self._actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass


class RayInstance:
    """The Ray actor: runs the instance's event loop on a thread of the actor's process and
    answers where it listens (its node's address, port, pid and Ray node id)."""

    def start(self, config: EngineConfig) -> tuple[str, int, int, str]:
        import queue
        import threading

        import ray

        ports: queue.Queue = queue.Queue()

        def run() -> None:
            try:
                anyio.run(serve_instance, config, "0.0.0.0", ports.put)
            except Exception as exc:
                ports.put(f"{type(exc).__name__}: {exc}")
            # the link closed: the engine has stopped; the launcher's ray.kill (or the driver's
            # exit, which takes its actors with it) ends the actor's process

        threading.Thread(target=run, daemon=True, name="shunter-instance").start()
        port = ports.get(timeout=START_TIMEOUT_S)
        if not isinstance(port, int):
            raise RuntimeError(port)
        return (ray.util.get_node_ip_address(), port, os.getpid(),
                ray.get_runtime_context().get_node_id())


def current_backend() -> str:
    try:
        import sniffio

        return sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:  # not inside an event loop
        return "asyncio"


class Attached:
    """Instances already running: nothing to launch, nothing to stop."""

    def __init__(self, launched: Sequence[Launched]) -> None:
        self._launched = list(launched)

    async def launch(self, index: int, config: EngineConfig) -> Launched:
        return self._launched[index]

    def shutdown(self) -> None:
        pass
