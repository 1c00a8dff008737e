"""Prometheus metrics of the gateway, counted cheaply on the request path and exported at scrape.

- ``dpcoord_gateway_requests_total{endpoint, status}``: answered HTTP requests (a stream counts
  once, with the status it started with)
- ``dpcoord_gateway_request_seconds{endpoint}``: time to the whole response (not streamed) or
  to the first event (streamed)
- ``dpcoord_gateway_requests_in_flight``
- ``dpcoord_gateway_client_disconnects_total``: requests aborted because the client left
- ``dpcoord_gateway_tokens_total{kind="prompt"|"completion"}``: usage reported to clients
- ``dpcoord_nats_connected``, ``dpcoord_nats_reconnects_total``
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from nats.aio.client import Client as NATS
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from service.gateway.schemas import Usage
from service.ops.latency import END_TO_END_BUCKETS, LatencyHistogram
from service.ops.metrics import nats_families


class GatewayMetrics(Collector):
    def __init__(self, connection: Callable[[], NATS | None]) -> None:
        self.responses: Counter[tuple[str, int]] = Counter()
        self.latency: dict[str, LatencyHistogram] = {}
        self.in_flight = 0
        self.disconnects = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._connection = connection

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.responses[(endpoint, status)] += 1
        histogram = self.latency.get(endpoint)
        if histogram is None:
            histogram = self.latency[endpoint] = LatencyHistogram(END_TO_END_BUCKETS)
        histogram.observe(seconds)

    def used(self, usage: Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "dpcoord_gateway_requests", "HTTP requests answered", labels=["endpoint", "status"]
        )
        for (endpoint, status), count in sorted(self.responses.items()):
            requests.add_metric([endpoint, str(status)], count)
        yield requests
        latency = HistogramMetricFamily(
            "dpcoord_gateway_request_seconds", "Time to the response (streams: to the first event)", labels=["endpoint"]
        )
        for endpoint, histogram in sorted(self.latency.items()):
            latency.add_metric([endpoint], histogram.cumulative(), histogram.sum)
        yield latency
        in_flight = GaugeMetricFamily("dpcoord_gateway_requests_in_flight", "HTTP requests being served")
        in_flight.add_metric([], self.in_flight)
        yield in_flight
        disconnects = CounterMetricFamily(
            "dpcoord_gateway_client_disconnects", "Requests aborted at the engines because the HTTP client left"
        )
        disconnects.add_metric([], self.disconnects)
        yield disconnects
        tokens = CounterMetricFamily("dpcoord_gateway_tokens", "Tokens reported in usage", labels=["kind"])
        tokens.add_metric(["prompt"], self.prompt_tokens)
        tokens.add_metric(["completion"], self.completion_tokens)
        yield tokens
        nc = self._connection()
        if nc is not None:
            yield from nats_families(nc)
