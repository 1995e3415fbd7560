"""`GET /metrics`: Prometheus text format, vLLM's metric names and buckets under `shunter:`.

Two sources. Per-request histograms and counters are fed when a request ends, from its
`RequestTimeline` (the server core calls `ServerMetrics.on_finished`). Gauges and engine-side
totals (queues, KV usage, preemptions, swap traffic, overload triggers, the cost model's online
correction, the running policy) are read from `engine.inspect()` at scrape time: nothing in the
engine is reset by a scrape.
Each server has its own `CollectorRegistry`, so two servers in one process never share counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.errors import ShunterError
from engine.outputs import GenerationChunk
from engine.params import SchedulingParams
from engine.snapshots import EngineSnapshot
from engine.timeline import RequestTimeline

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its Grafana dashboards read these unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TRIGGERS = ("drop", "restore")
"""KunServe's overload triggers (§4.1 drop layers, §4.4 restore them)."""


class ServerMetrics:
    """The registry behind one server's `/metrics`, and the callback that feeds it."""

    def __init__(self, engine: Any, *, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._engine_side = _EngineCollector(engine, model_name)
        if hasattr(engine, "instances"):  # a cluster: every instance, labelled
            from shunter.server.cluster_metrics import ClusterCollector

            self._engine_side = ClusterCollector(self._engine_side)
        self.registry.register(self._engine_side)
        per_class = ["model_name", "request_class"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, per_class, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        self.ttft = histogram("shunter:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("shunter:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("shunter:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("shunter:request_queue_time_seconds",
                               "Histogram of time spent waiting before the first step, in seconds.",
                               REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = counter("shunter:prompt_tokens",
                                     "Number of prefill tokens processed.", ["model_name"])
        self.generation_tokens = counter("shunter:generation_tokens",
                                         "Number of generation tokens processed.", ["model_name"])
        self.finished = counter("shunter:request_success",
                                "Count of finished requests, by finish reason "
                                "(stop, length, cancelled, error).",
                                ["model_name", "finished_reason"])
        self.slo_attained = counter("shunter:slo_attained",
                                    "Requests that met their TTFT or TPOT deadline.",
                                    ["model_name", "request_class", "metric"])
        self.slo_missed = counter("shunter:slo_missed",
                                  "Requests that missed their TTFT or TPOT deadline.",
                                  ["model_name", "request_class", "metric"])

    def on_finished(self, chunk: GenerationChunk | None, finish_reason: str,
                    scheduling: SchedulingParams) -> None:
        """A request ended (the server core's `app.state.on_finished` callback)."""
        self.finished.labels(self.model_name, finish_reason).inc()
        timeline = chunk.timeline if chunk is not None else None
        if timeline is not None:
            self.observe(timeline)

    def observe(self, t: RequestTimeline) -> None:
        labels = (self.model_name, t.request_class)
        self.prompt_tokens.labels(self.model_name).inc(t.prompt_tokens)
        self.generation_tokens.labels(self.model_name).inc(t.output_tokens)
        self.e2e.labels(*labels).observe(t.e2e_s)
        if t.queue_s is not None:
            self.queue.labels(*labels).observe(t.queue_s)
        if t.ttft_s is not None:
            self.ttft.labels(*labels).observe(t.ttft_s)
        itl = self.itl.labels(*labels)
        for gap in t.tbt_s:
            itl.observe(gap)
        # BROS §7.1: TTFT and TPOT attainment are judged separately, each against its deadline
        for metric, value, slo_ms in (("ttft", t.ttft_s, t.ttft_slo_ms),
                                      ("tpot", t.tpot_s, t.tpot_slo_ms)):
            if value is None or slo_ms is None or t.finish_reason == "error":
                continue
            met = value * 1000.0 <= slo_ms
            (self.slo_attained if met else self.slo_missed).labels(*labels, metric).inc()

    async def render(self) -> bytes:
        """The exposition text; engine-side metrics are left out once the engine has stopped."""
        try:
            self._engine_side.snapshot = await self.engine.inspect()
        except ShunterError:
            self._engine_side.snapshot = None
        try:
            return generate_latest(self.registry)
        finally:
            self._engine_side.snapshot = None

    def routes(self) -> list[Route]:
        async def metrics(_: Request) -> Response:
            return Response(await self.render(), media_type=CONTENT_TYPE_LATEST)

        return [Route("/metrics", metrics, methods=["GET"])]


class _EngineCollector(Collector):
    """Gauges and totals read from the snapshot the scrape just took."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.snapshot: EngineSnapshot | None = None

    def describe(self) -> list:
        return []  # collected only at scrape time, from a snapshot taken then

    def collect(self) -> Iterator[Any]:
        policy = GaugeMetricFamily("shunter:policy_info", "The running policy and its version "
                                   "(1 at start, +1 per replacement or rollback).",
                                   labels=["name", "version"])
        policy.add_metric([self.engine.policy.settings.name, str(self.engine.policy_version)], 1)
        yield policy
        snap = self.snapshot
        if snap is None:
            return
        s, m = snap.scheduler, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("shunter:num_requests_running", "Number of requests in the running batch.",
                    s.running)
        yield gauge("shunter:num_requests_waiting", "Number of requests waiting to be scheduled.",
                    s.waiting)
        yield gauge("shunter:num_requests_swapped",
                    "Number of requests whose KV is on the host (swapped or swapping in).",
                    s.swapped + s.swapping_in)
        used = (s.total_blocks - s.free_blocks) / s.total_blocks if s.total_blocks else 0.0
        yield gauge("shunter:kv_cache_usage_perc",
                    "Fraction of device KV blocks in use (0 to 1).", used)
        yield counter("shunter:num_preemptions", "Cumulative number of preemptions.",
                      s.preemptions)
        yield from self._swap(snap)
        yield from self._prefix_cache(snap)
        trigger = GaugeMetricFamily("shunter:overload_trigger",
                                    "1 while the policy's overload trigger fires (KunServe).",
                                    labels=["model_name", "trigger"])
        fired = CounterMetricFamily("shunter:overload_trigger_fired",
                                    "How often each overload trigger started firing.",
                                    labels=["model_name", "trigger"])
        for name, count in zip(TRIGGERS, (s.overload_drops, s.overload_restores)):
            trigger.add_metric([self.model_name, name], 1 if s.overload == name else 0)
            fired.add_metric([self.model_name, name], count)
        yield trigger
        yield fired
        if s.cost_correction is not None:
            factor = GaugeMetricFamily(
                "shunter:cost_model_correction", "What the online correction multiplies the "
                "cost model's iteration predictions by, per phase (1: the model is right; 2: "
                "steps take twice what it says).", labels=["model_name", "phase"])
            for phase, f in zip(("decode", "prefill"), s.cost_correction):
                factor.add_metric([self.model_name, phase], f)
            yield factor

    def _prefix_cache(self, snap: EngineSnapshot) -> Iterator[Any]:
        """Device prefix cache lookups and hits since the start, in tokens as vLLM counts them
        (`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`) and in blocks; zeros while no
        policy has turned the cache on."""
        c, m = snap.scheduler.prefix_cache, [self.model_name]
        for name, doc, value in (
                ("queries", "Tokens of admitted requests looked up in the prefix cache.",
                 c.queried_tokens if c else 0),
                ("hits", "Of those, tokens found cached (not computed again).",
                 c.hit_tokens if c else 0),
                ("block_queries", "Full KV blocks looked up in the prefix cache.",
                 c.queried_blocks if c else 0),
                ("block_hits", "Of those, blocks found cached.", c.hit_blocks if c else 0),
                ("evictions", "Cached blocks evicted (least recently used) to make room.",
                 c.evicted_blocks if c else 0)):
            counter = CounterMetricFamily(f"shunter:prefix_cache_{name}", doc,
                                          labels=["model_name"])
            counter.add_metric(m, value)
            yield counter
        blocks = GaugeMetricFamily("shunter:prefix_cache_blocks", "Device KV blocks the prefix "
                                   "cache holds (in use or idle).", labels=["model_name"])
        blocks.add_metric(m, snap.allocator.cached_blocks)
        yield blocks

    def _swap(self, snap: EngineSnapshot) -> Iterator[Any]:
        """Swap traffic since the start; zeros for an engine that cannot swap."""
        c = snap.swap
        m = self.model_name
        swap_bytes = CounterMetricFamily("shunter:swap_bytes", "KV bytes copied by swapping.",
                                         labels=["model_name", "direction"])
        calls = CounterMetricFamily("shunter:swap_copy_calls",
                                    "Copy calls issued by swapping (FastSwitch's block groups "
                                    "make them few).", labels=["model_name", "direction"])
        out_calls = (c.copy_ops - c.copy_ops_in) if c else 0
        for direction, nbytes, ncalls in (("out", c.bytes_out if c else 0, out_calls),
                                          ("in", c.bytes_in if c else 0, c.copy_ops_in if c else 0)):
            swap_bytes.add_metric([m, direction], nbytes)
            calls.add_metric([m, direction], ncalls)
        yield swap_bytes
        yield calls
        stall = CounterMetricFamily("shunter:swap_stall_seconds",
                                    "Step time lost waiting for swap-ins.", labels=["model_name"])
        stall.add_metric([m], c.stall_s if c else 0.0)
        yield stall
