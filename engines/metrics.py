"""Prometheus metrics of one engine, read from the runtime when scraped.

The chart's dashboard and alerts (helm/dpcoord/dashboards, templates/prometheusrule.yaml) query
these names; tests/integration/test_monitoring_queries.py holds them to what is exported here.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engines.backend import ExecutionPath, PrefixCacheStats
from engines.runtime import EngineRuntime
from service.ops.metrics import histogram_family, nats_families


class EngineCollector(Collector):
    """Built once the runtime has started (it reads ``runtime.nc``)."""

    def __init__(self, runtime: EngineRuntime) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[Metric]:
        runtime = self._runtime
        active = GaugeMetricFamily("dpcoord_engine_active_requests", "Requests this engine is generating")
        active.add_metric([], runtime.load)
        yield active

        waiting = GaugeMetricFamily(
            "dpcoord_engine_waiting_requests",
            "Of the active requests, those not running yet (waiting for a place in the batch or for KV-cache pages)",
        )
        waiting.add_metric([], runtime.backend.waiting_requests())
        yield waiting

        held = GaugeMetricFamily(
            "dpcoord_engine_held_requests",
            "Of the active requests, those held back by backpressure: their readers fell behind (not stepped)",
        )
        held.add_metric([], len(runtime.requests.held_back()))
        yield held

        generated = CounterMetricFamily("dpcoord_engine_generated_tokens", "Tokens this engine generated")
        generated.add_metric([], runtime.pace.generated)
        yield generated
        yield histogram_family(
            "dpcoord_engine_inter_token_seconds",
            "Time between a request's consecutive tokens, one step apart (pauses included)",
            runtime.pace.inter_token,
        )

        registered = GaugeMetricFamily("dpcoord_engine_registered", "1 once a coordinator acknowledged this engine")
        registered.add_metric([], 1.0 if runtime.registered.is_set() else 0.0)
        yield registered

        paused = GaugeMetricFamily("dpcoord_engine_paused", "1 while paused or suspended by a control signal")
        paused.add_metric([], 1.0 if runtime.paused else 0.0)
        yield paused

        weights = GaugeMetricFamily(
            "dpcoord_engine_weight_version_info",
            "1, labelled with the weight version this engine serves ('' before any update_weights)",
            labels=["version"],
        )
        version = runtime.weights.version
        weights.add_metric(["" if version is None else str(version)], 1.0)
        yield weights

        malformed = CounterMetricFamily(
            "dpcoord_malformed_messages", "Routed or broadcast messages that failed to decode"
        )
        malformed.add_metric([], runtime.counters["malformed"])
        yield malformed

        yield from prefix_cache_families(runtime.backend.prefix_cache_stats())
        yield from execution_path_families(runtime.backend.execution_path())
        yield from nats_families(runtime.nc)


def prefix_cache_families(stats: PrefixCacheStats | None) -> Iterator[Metric]:
    """The KV cache's prefix-cache counters; nothing for a backend without a KV cache."""
    if stats is None:
        return
    queried = CounterMetricFamily(
        "dpcoord_engine_prefix_cache_queried_tokens", "Prompt tokens of the requests admitted to the KV cache"
    )
    queried.add_metric([], stats.queried_tokens)
    yield queried
    hits = CounterMetricFamily(
        "dpcoord_engine_prefix_cache_hit_tokens", "Of them, tokens read from cached pages instead of computed"
    )
    hits.add_metric([], stats.hit_tokens)
    yield hits
    rate = GaugeMetricFamily(
        "dpcoord_engine_prefix_cache_hit_rate", "Hit tokens / queried tokens since the engine started"
    )
    rate.add_metric([], stats.hit_rate)
    yield rate
    cached = GaugeMetricFamily(
        "dpcoord_engine_prefix_cache_pages", "KV-cache pages holding a known prompt prefix, in use or not"
    )
    cached.add_metric([], stats.cached_pages)
    yield cached
    evicted = CounterMetricFamily(
        "dpcoord_engine_prefix_cache_evicted_pages", "Cached pages reused for other tokens under memory pressure"
    )
    evicted.add_metric([], stats.evicted_pages)
    yield evicted
    total = GaugeMetricFamily("dpcoord_engine_kv_cache_pages", "KV-cache pages in all")
    total.add_metric([], stats.total_pages)
    yield total


def execution_path_families(path: ExecutionPath | None) -> Iterator[Metric]:
    """Which fast pieces decode runs (1 on, 0 off) and how many failed to build; nothing for echo."""
    if path is None:
        return
    pieces = GaugeMetricFamily(
        "dpcoord_engine_fast_path", "1 where decode runs the fast piece named by the label", labels=["piece"]
    )
    pieces.add_metric(["cuda_graphs"], float(path.cuda_graphs))
    pieces.add_metric(["paged_kernel"], float(path.paged_kernel))
    pieces.add_metric(["compiled"], float(path.compiled))
    yield pieces
    failures = CounterMetricFamily(
        "dpcoord_engine_fast_path_failures", "Fast-path pieces that failed to build (tracebacks in the log)"
    )
    failures.add_metric([], len(path.failures))
    yield failures
