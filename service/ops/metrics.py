"""Metric building blocks shared by the coordinator and the engines: histogram families from
plain bucket counts, error-code breakdowns of counters, and NATS connection health."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from nats.aio.client import Client as NATS
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from service.ops.latency import LatencyHistogram


def histogram_family(name: str, documentation: str, histogram: LatencyHistogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, documentation, buckets=histogram.cumulative(), sum_value=histogram.sum)


def codes_of(counters: Counter[str], prefix: str) -> dict[str, int]:
    """``{"503": 2}`` from counters named ``<prefix>503``."""
    return {key.removeprefix(prefix): value for key, value in counters.items() if key.startswith(prefix)}


def nats_families(nc: NATS) -> Iterator[Metric]:
    """Connection health shared by the coordinator and the engines."""
    connected = GaugeMetricFamily("dpcoord_nats_connected", "1 while the NATS connection is up")
    connected.add_metric([], 1.0 if nc.is_connected else 0.0)
    yield connected
    reconnects = CounterMetricFamily("dpcoord_nats_reconnects", "Reconnections to NATS since start")
    reconnects.add_metric([], nc.stats["reconnects"])
    yield reconnects
