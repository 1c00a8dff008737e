"""Prometheus metrics of one engine, read from the runtime when scraped."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engines.runtime import EngineRuntime
from service.ops.metrics import nats_families


class EngineCollector(Collector):
    """Built once the runtime has started (it reads ``runtime.nc``)."""

    def __init__(self, runtime: EngineRuntime) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[Metric]:
        runtime = self._runtime
        active = GaugeMetricFamily("dpcoord_engine_active_requests", "Requests this engine is generating")
        active.add_metric([], runtime.load)
        yield active

        registered = GaugeMetricFamily("dpcoord_engine_registered", "1 once a coordinator acknowledged this engine")
        registered.add_metric([], 1.0 if runtime.registered.is_set() else 0.0)
        yield registered

        paused = GaugeMetricFamily("dpcoord_engine_paused", "1 while paused or suspended by a control signal")
        paused.add_metric([], 1.0 if runtime.paused else 0.0)
        yield paused

        malformed = CounterMetricFamily("dpcoord_malformed_messages", "Routed or broadcast messages that failed to decode")
        malformed.add_metric([], runtime.counters["malformed"])
        yield malformed

        yield from nats_families(runtime.nc)
