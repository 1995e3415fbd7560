"""`/metrics` and `/admin/stats` for a server fronting a cluster: the engine-side metrics of
every live instance, each sample labelled with its `instance`, and the stats per instance.

The per-instance families are the single engine's (`_EngineCollector` in metrics.py), run once
per instance snapshot and merged, so the two stay the same metrics by construction."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class ClusterCollector(Collector):
    """Set `snapshot` (a ClusterSnapshot) before a scrape; None leaves the engine side out."""

    def __init__(self, per_instance: Any) -> None:
        self._inner = per_instance
        """An `_EngineCollector` over the cluster (its policy and version are the cluster's)."""
        self.snapshot: Any = None

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        snap = self.snapshot
        if snap is None:
            self._inner.snapshot = None
            yield from self._inner.collect()  # the policy alone
            return
        merged: dict[str, Metric] = {}
        for i, one in enumerate(snap.snapshots):
            if one is None:
                continue
            self._inner.snapshot = one
            for family in self._inner.collect():
                if family.name == "shunter:policy_info" and family.name in merged:
                    continue
                out = merged.setdefault(family.name, Metric(family.name, family.documentation,
                                                            family.type))
                for s in family.samples:
                    labels = s.labels if family.name == "shunter:policy_info" else (
                        s.labels | {"instance": str(i)})
                    out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        self._inner.snapshot = None
        up = GaugeMetricFamily("shunter:instance_up", "1 while the instance serves, 0 once "
                               "it died.", labels=["model_name", "instance"])
        for i, failure in enumerate(snap.failures):
            up.add_metric([self._inner.model_name, str(i)], 0 if failure else 1)
        yield from merged.values()
        yield up


def cluster_stats_json(snap: Any) -> dict:
    """`/admin/stats` of a cluster: each instance's dispatch view, failure and scheduler."""
    return {"instances": [
        {"instance": v.index, "alive": v.alive, "failure": f, "dispatch": v._asdict(),
         "scheduler": attrs.asdict(s.scheduler) if s is not None else None}
        for v, s, f in zip(snap.views, snap.snapshots, snap.failures)]}
