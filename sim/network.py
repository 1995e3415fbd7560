"""Links between instances for the simulated pipeline: the time to send one tensor between
two stages is `latency_s + bytes / bytes_per_s`, fitted by least squares to Vidur's measured
send/recv times (`../shared/profiles/vidur/network/<name>/send_recv.csv.gz`: median ms by
message size, 2 KB to 64 MB, two workers)."""

from __future__ import annotations

import csv
import gzip
from pathlib import Path

import attrs


@attrs.frozen(kw_only=True)
class NetworkLink:
    name: str
    latency_s: float
    bytes_per_s: float

    def send_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes else 0.0


# Fitted with `fit_link` from Vidur's a100_dgx send_recv.csv.gz (994 sizes each):
LINKS = {
    # two workers on two nodes (one GPU per node): the network between machines
    "a100-internode": NetworkLink(name="a100-internode", latency_s=42.9e-6, bytes_per_s=7.83e9),
    # two GPUs of one DGX node: NVLink
    "a100-nvlink": NetworkLink(name="a100-nvlink", latency_s=4.70e-6, bytes_per_s=234.5e9),
}


def fit_link(path: str | Path, *, devices_per_node: int, name: str) -> NetworkLink:
    """Least-squares latency and bandwidth from one Vidur send_recv file (rows with two
    workers and `devices_per_node` GPUs per node)."""
    xs, ys = [], []
    with gzip.open(path, "rt") as f:
        for row in csv.DictReader(f):
            if row["num_workers"] == "2" and row["devices_per_node"] == str(devices_per_node):
                xs.append(float(row["size"]))
                ys.append(float(row["time_stats.send_recv.median"]) / 1e3)
    if len(xs) < 2:
        raise ValueError(f"{path}: no send/recv rows for 2 workers, {devices_per_node} per node")
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return NetworkLink(name=name, latency_s=(sy - slope * sx) / n, bytes_per_s=1.0 / slope)
