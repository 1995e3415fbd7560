"""KunServe §4.2 on the torch data plane: does a KV exchange delay a pipeline's activations?

    python bench/kunserve_exchange.py [--rounds 3] [--kv-mib 64] [--chunk-mib 2]
                                      [--act-kib 512] [--steps 40]

Two processes joined over gloo (loopback TCP), each with its instance's `TransferQueue`
(gpu/transfer.py). Rank 0 plays the head: every step it queues one activation tensor
(--act-kib) for rank 1 and waits for rank 1's one-int answer (the next stage's "done"), timing
the round trip; it paces steps by a fixed compute time (--compute-ms, a sleep, as a stage's
compute would). Three ways, in interleaved rounds, all in the same two processes:

- alone: no KV traffic;
- coordinated: a KV exchange of --kv-mib in --chunk-mib chunks through the queue's KV lane
  (activations never wait behind it; the KV lane yields to queued activations), received by a
  thread on rank 1 (gpu/kv_exchange.py's arrangement);
- fifo: the same exchange through the activation lane, in one order with the activations (what
  one unprioritised queue does: an activation queued behind chunks waits for them).

Reports the activation round trip (p50, p99, max) and the exchange's duration per way. Writes
bench/results/kunserve_exchange_torch.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_ACT_TAG, _ACK_TAG, _KV_TAG, _CTRL_TAG = 1, 2, 1 << 20, 3


def _worker(rank: int, port: int, args, out_q) -> None:
    import torch
    import torch.distributed as dist

    from gpu.transfer import TransferQueue

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    act = torch.ones(args.act_kib * 256)  # float32
    chunk_elems = args.chunk_mib * 2**18
    n_chunks = args.kv_mib // args.chunk_mib
    results = []
    q = TransferQueue()
    for rnd in range(args.rounds):
        for way in ("alone", "coordinated", "fifo"):
            if rank == 0:
                kv = [torch.full((chunk_elems,), float(i)) for i in range(n_chunks)]
                began = time.perf_counter()
                if way != "alone":
                    kind = "kv" if way == "coordinated" else "activation"
                    for i, c in enumerate(kv):
                        q.put(c, dst=1, tag=_KV_TAG + i, kind=kind)
                rtts = []
                for s in range(args.steps):
                    time.sleep(args.compute_ms / 1000)
                    t0 = time.perf_counter()
                    q.put_activation(act, dst=1, tag=_ACT_TAG)
                    ack = torch.empty(1, dtype=torch.int64)
                    dist.recv(ack, src=1, tag=_ACK_TAG)
                    rtts.append(time.perf_counter() - t0)
                q.flush()
                done = torch.empty(1)
                dist.recv(done, src=1, tag=_CTRL_TAG)  # rank 1's exchange duration
                results.append({"round": rnd, "way": way, "rtt_s": rtts,
                                "exchange_s": float(done[0]) if way != "alone" else 0.0,
                                "wall_s": time.perf_counter() - began})
            else:
                got = {}

                def recv_kv() -> None:
                    buf = torch.empty(chunk_elems)
                    t0 = time.perf_counter()
                    for i in range(n_chunks):
                        dist.recv(buf, src=0, tag=_KV_TAG + i)
                    got["s"] = time.perf_counter() - t0

                th = None
                if way != "alone":
                    th = threading.Thread(target=recv_kv)
                    th.start()
                x = torch.empty_like(act)
                for _ in range(args.steps):
                    dist.recv(x, src=0, tag=_ACT_TAG)
                    dist.send(torch.ones(1, dtype=torch.int64), dst=0, tag=_ACK_TAG)
                if th is not None:
                    th.join()
                dist.send(torch.tensor([got.get("s", 0.0)]), dst=0, tag=_CTRL_TAG)
    q.close()
    if rank == 0:
        out_q.put(results)
    dist.destroy_process_group()


def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--chunk-mib", type=int, default=2)
    ap.add_argument("--act-kib", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--compute-ms", type=float, default=5.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"
                                         / "kunserve_exchange_torch.json"))
    args = ap.parse_args()
    import multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, out_q)) for r in range(2)]
    for p in procs:
        p.start()
    results = out_q.get(timeout=1200)
    for p in procs:
        p.join(timeout=30)
    summary = {}
    for way in ("alone", "coordinated", "fifo"):
        rtts = [x for r in results if r["way"] == way for x in r["rtt_s"]]
        ex = [r["exchange_s"] for r in results if r["way"] == way]
        summary[way] = {"rtt_p50_ms": _pct(rtts, 50) * 1e3, "rtt_p99_ms": _pct(rtts, 99) * 1e3,
                        "rtt_max_ms": max(rtts) * 1e3,
                        "exchange_s_mean": statistics.mean(ex)}
        print(f"{way:12s} activation round trip p50 {summary[way]['rtt_p50_ms']:7.2f} ms  "
              f"p99 {summary[way]['rtt_p99_ms']:7.2f} ms  max {summary[way]['rtt_max_ms']:7.2f}"
              f" ms  exchange {summary[way]['exchange_s_mean']:.3f} s")
    Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary,
                                          "rounds": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
