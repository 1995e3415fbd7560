"""A torch instance's runner in its own process, driven through a pipe by a test (the role the
instance's engine plays in serving): solo steps on its TorchRunner, leading a pipeline group
(GroupRunner) or serving one as a member (serve_member), restore and fault recovery. Every
tensor between instances goes over the data plane (gloo); the pipe carries attrs messages."""

from __future__ import annotations

import traceback


def host_main(rank: int, world: int, init: str, model_dir: str, num_blocks: int,
              block_size: int, conn) -> None:
    import faulthandler
    import signal

    import torch

    from engine.config import EngineConfig
    from gpu.config import ModelConfig
    from gpu.data_plane import GroupMemberLost, data_plane, join_data_plane
    from gpu.group_runner import GroupRunner, serve_member
    from gpu.runner import TorchRunner

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    try:
        join_data_plane(init, rank, world, timeout_s=60)
        config = EngineConfig(model=model_dir, device="cpu", threads=1, num_blocks=num_blocks,
                              block_size=block_size, cpu_swap_blocks=0)
        runner = TorchRunner(config, ModelConfig.from_dir(model_dir), num_blocks)
        ids = runner._load()
    except Exception:
        conn.send(("error", traceback.format_exc(limit=6)))
        return
    conn.send(("ready", (ids.start, ids.stop)))
    group: GroupRunner | None = None
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "stop":
                conn.send(("ok", None))
                return
            if cmd == "step":
                if group is None:
                    conn.send(("ok", (runner.execute(args[0]), ())))
                else:
                    done = group.execute(args[0])
                    conn.send(("ok", (done, tuple(group.arrived()))))
            elif cmd == "form":
                ranks, layers, adopted, chunk_blocks = args
                group = GroupRunner(runner, ranks, layers, adopted, chunk_blocks=chunk_blocks)
                pool = group.open()
                conn.send(("ok", ((pool.start, pool.stop), tuple(group.arrived()))))
            elif cmd == "member":
                conn.send(("ok", serve_member(runner, args[0])))
            elif cmd == "restore":
                group.restore(args[0], source=args[1], release=args[2])
                ex = group.exchange
                conn.send(("ok", (group.restore_stats, {
                    "sent_bytes": ex.sent_bytes, "received_bytes": ex.received_bytes,
                    "chunks_received": ex.chunks_received, "ready_s": dict(ex.ready_s)})))
                group = None
            elif cmd == "recover":
                conn.send(("ok", group.recover_from_host(args[0])))
                group = None
            elif cmd == "queue_bytes":
                conn.send(("ok", dict(data_plane().queue.sent_bytes)))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except GroupMemberLost as exc:
            conn.send(("lost", str(exc)))
        except Exception:
            conn.send(("error", traceback.format_exc(limit=8)))
