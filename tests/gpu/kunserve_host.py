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

    import attrs
    import torch

    from engine.config import EngineConfig
    from gpu.config import ModelConfig
    from gpu.data_plane import GroupMemberLost, join_data_plane
    from gpu.group_member import serve_member
    from gpu.kunserve_runner import GroupLost, KunServeTorchRunner

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    try:
        join_data_plane(init, rank, world, timeout_s=60)
        config = EngineConfig(model=model_dir, device="cpu", threads=1, num_blocks=num_blocks,
                              block_size=block_size, cpu_swap_blocks=0)
        runner = KunServeTorchRunner(config, ModelConfig.from_dir(model_dir), num_blocks,
                                     chunk_blocks=2)
        ids = runner._load()
    except Exception:
        conn.send(("error", traceback.format_exc(limit=6)))
        return
    conn.send(("ready", (ids.start, ids.stop)))
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "stop":
                conn.send(("ok", None))
                return
            if cmd == "step":  # the step's group/pool_blocks/moves fields drive the group
                done = runner.execute(args[0])
                group = runner.group
                conn.send(("ok", (done, tuple(group.arrived()) if group is not None else ())))
            elif cmd == "grow":  # the group this instance leads grows (gpu/group_grow.py)
                conn.send(("ok", runner.grow(*args)))
            elif cmd == "grow_stats":
                g = runner.group or runner.last_group
                conn.send(("ok", attrs.asdict(g.grow_stats)))
            elif cmd == "prefetch":  # start the restore while the group serves
                assert runner.prefetch_restore(*args), runner.prefetch_refused
                conn.send(("ok", None))
            elif cmd == "ready":  # whether every member's prefetched weights are in
                conn.send(("ok", runner.group.restore_ready()))
            elif cmd == "kv":  # a solo request's KV of its first n tokens: [n, L, 2, H, D]
                rid, n = args
                kv = runner._model.arena.kv[torch.tensor(runner._seqs[rid].table, dtype=torch.long)]
                conn.send(("ok", kv.permute(0, 3, 1, 2, 4, 5).reshape(
                    -1, *kv.shape[1:3], *kv.shape[4:])[:n].clone()))
            elif cmd == "expect_adopted":
                runner.expect_adopted(args[0])
                conn.send(("ok", None))
            elif cmd == "member":
                conn.send(("ok", serve_member(runner, args[0])))
            elif cmd == "die_after_go":  # a member that goes away as its group starts: it
                # joins the group's channel, then exits before taking or sending a chunk
                import os

                from gpu.data_plane import CONTROL_TAG, data_plane, open_channel, recv_obj

                start = recv_obj(args[0], CONTROL_TAG, "the group was formed")
                recv_obj(args[0], CONTROL_TAG, "the group was formed")  # GroupGo
                open_channel(data_plane(), start.channel, start.ranks)
                os._exit(0)
            elif cmd == "group_stats":
                g = runner.last_group or runner.group
                ex = g.exchange
                conn.send(("ok", (g.restore_stats, {
                    "sent_bytes": ex.sent_bytes, "received_bytes": ex.received_bytes,
                    "chunks_received": ex.chunks_received, "ready_s": dict(ex.ready_s)})))
            elif cmd == "recover":  # the failed step already restored from the host copy
                assert runner.group is None and runner.lost is not None, runner.lost
                conn.send(("ok", sorted(runner._seqs)))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except (GroupMemberLost, GroupLost) as exc:
            conn.send(("lost", str(exc)))
        except Exception:
            conn.send(("error", traceback.format_exc(limit=8)))
