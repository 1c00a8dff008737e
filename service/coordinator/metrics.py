"""Prometheus metrics of the coordinator, read from its own state when scraped.

Nothing here runs on the request path: counts, gauges and the engine pool are read by
``CoordinatorCollector`` at scrape time, and the latency histograms are the plain bucket
counts of ``service.ops.latency``.

Which coordinator counter feeds which metric:

- ``submitted`` → ``dpcoord_requests_submitted_total``
- ``completed`` (every terminal reply) minus ``failed_<code>`` → ``dpcoord_requests_total{outcome="relayed"}``:
  terminal replies relayed from engines. The coordinator forwards their bodies undecoded (that
  is what keeps it cheap), so these are finals and the few errors engines produce themselves.
- ``failed_<code>`` → ``dpcoord_requests_total{outcome="failed", code}``: errors the coordinator
  answered an admitted request with (deadline 504, engine lost 503, ...)
- ``submit_without_reply`` → ``dpcoord_requests_total{outcome="dropped"}``
- ``error_<code>`` (messages refused before admission, any subject) → ``dpcoord_refused_messages_total{code}``
- ``error_400`` → ``dpcoord_malformed_messages_total``
- ``retried`` → ``dpcoord_requests_retried_total``; ``late_replies`` → ``dpcoord_late_replies_total``
- ``routed_messages`` and ``routed_requests`` → ``dpcoord_routed_messages_total`` and
  ``dpcoord_routed_requests_total`` (requests to engines, and the NATS messages that carried
  them), and their ratio → ``dpcoord_requests_per_routed_message``
- ``engines_silent`` (engines removed after ``heartbeat_timeout_s`` without a heartbeat) →
  ``dpcoord_engines_silent_total``
- every counter, by its name → ``dpcoord_coordinator_events_total{event}``, so counters added
  to the coordinator are exported without a change here

The block index (``coordinator.blocks``) gives ``dpcoord_kv_index_{engines,entries,prefixes,predictions}``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.ops.metrics import codes_of, histogram_family, nats_families
from service.protocol.state import CoordinatorState

if TYPE_CHECKING:
    from service.coordinator.block_index import BlockIndex
    from service.coordinator.coordinator import Coordinator


class CoordinatorCollector(Collector):
    """Built once the coordinator has started (it reads ``coordinator.nc``)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        coordinator = self._coordinator
        counters = coordinator.counters
        failed = codes_of(counters, "failed_")

        submitted = CounterMetricFamily("dpcoord_requests_submitted", "Requests admitted by this coordinator")
        submitted.add_metric([], counters["submitted"])
        yield submitted

        outcomes = CounterMetricFamily(
            "dpcoord_requests", "Requests by terminal outcome (error codes as on the wire)", labels=["outcome", "code"]
        )
        outcomes.add_metric(["relayed", ""], counters["completed"] - sum(failed.values()))
        for code, value in sorted(failed.items()):
            outcomes.add_metric(["failed", code], value)
        outcomes.add_metric(["dropped", ""], counters["submit_without_reply"])
        yield outcomes

        refused = CounterMetricFamily(
            "dpcoord_refused_messages", "Messages answered with an error before admission, any subject", labels=["code"]
        )
        for code, value in sorted(codes_of(counters, "error_").items()):
            refused.add_metric([code], value)
        yield refused

        malformed = CounterMetricFamily(
            "dpcoord_malformed_messages", "Messages that failed to decode or validate (400)"
        )
        malformed.add_metric([], counters["error_400"])
        yield malformed

        retried = CounterMetricFamily("dpcoord_requests_retried", "Requests routed again after their engine was lost")
        retried.add_metric([], counters["retried"])
        yield retried

        silent = CounterMetricFamily(
            "dpcoord_engines_silent", "Engines removed from the pool after heartbeat_timeout_s without a heartbeat"
        )
        silent.add_metric([], counters["engines_silent"])
        yield silent

        late = CounterMetricFamily("dpcoord_late_replies", "Engine replies that arrived after their request ended")
        late.add_metric([], counters["late_replies"])
        yield late

        routed_messages = CounterMetricFamily(
            "dpcoord_routed_messages", "Messages that carried routed requests to engines (one per engine per loop turn)"
        )
        routed_messages.add_metric([], counters["routed_messages"])
        yield routed_messages
        routed_requests = CounterMetricFamily("dpcoord_routed_requests", "Requests routed to engines, retries included")
        routed_requests.add_metric([], counters["routed_requests"])
        yield routed_requests
        per_message = GaugeMetricFamily(
            "dpcoord_requests_per_routed_message",
            "Routed requests per routed message since start (rate(dpcoord_routed_requests_total) / "
            "rate(dpcoord_routed_messages_total) gives it over a window)",
        )
        per_message.add_metric(
            [], counters["routed_requests"] / counters["routed_messages"] if counters["routed_messages"] else 0.0
        )
        yield per_message

        events = CounterMetricFamily("dpcoord_coordinator_events", "Every internal counter, by name", labels=["event"])
        for event, value in sorted(counters.items()):
            events.add_metric([event], value)
        yield events

        in_flight = GaugeMetricFamily("dpcoord_requests_in_flight", "Requests admitted and not yet answered")
        in_flight.add_metric([], len(coordinator.requests))
        yield in_flight

        queued = GaugeMetricFamily(
            "dpcoord_requests_queued",
            "Of the requests in flight, those waiting in this coordinator's queue for an engine",
        )
        queued.add_metric([], coordinator.requests.queued)
        yield queued

        engines = GaugeMetricFamily("dpcoord_engines_connected", "Engines in the coordinator's pool")
        engines.add_metric([], len(coordinator.engines))
        yield engines

        per_engine = GaugeMetricFamily(
            "dpcoord_engine_in_flight", "Requests routed to each engine and not yet answered", labels=["engine_id"]
        )
        capacity = GaugeMetricFamily(
            "dpcoord_engine_capacity", "Requests each engine is given at once", labels=["engine_id"]
        )
        for record in coordinator.engines:
            per_engine.add_metric([record.engine_id], record.load)
            capacity.add_metric([record.engine_id], record.capacity)
        yield per_engine
        yield capacity

        yield from _kv_index_families(coordinator.blocks)

        state = GaugeMetricFamily(
            "dpcoord_coordinator_state", "1 for the coordinator's current state", labels=["state"]
        )
        for candidate in CoordinatorState:
            state.add_metric([candidate.value], 1.0 if coordinator.state is candidate else 0.0)
        yield state

        weights = GaugeMetricFamily(
            "dpcoord_fleet_weight_version_info",
            "1, labelled with the weight version the fleet serves, which every engine in the pool serves "
            "('' before any update_weights)",
            labels=["version"],
        )
        version = coordinator.control_state.weight_version
        weights.add_metric(["" if version is None else str(version)], 1.0)
        yield weights

        yield histogram_family(
            "dpcoord_request_duration_seconds",
            "Admission to terminal reply, as the coordinator sees it",
            coordinator.latency.end_to_end,
        )
        yield histogram_family(
            "dpcoord_time_to_first_token_seconds",
            "Admission to the first streamed partial (streamed requests)",
            coordinator.latency.first_token,
        )
        yield from nats_families(coordinator.nc)


def _kv_index_families(index: BlockIndex) -> Iterator[Metric]:
    """The block index's size against its bound (``kv_index_size``), for ``cache_aware`` routing."""
    for name, text, count in (
        ("dpcoord_kv_index_engines", "Engines whose KV events feed this coordinator's block index", len(index.engines)),
        (
            "dpcoord_kv_index_entries",
            "(engine, prefix) pairs the block index holds from KV events; at most kv_index_size",
            index.entries,
        ),
        ("dpcoord_kv_index_prefixes", "Prompt prefixes the block index knows, held or predicted", len(index)),
        (
            "dpcoord_kv_index_predictions",
            "Routing's predictions alive: prompts counted as held on route",
            index.predictions,
        ),
    ):
        gauge = GaugeMetricFamily(name, text)
        gauge.add_metric([], count)
        yield gauge
