"""Tracing with OpenTelemetry: optional, and free when off.

Contract:
- Tracing is on in a process when ``otlp_endpoint`` is set (and the ``otel`` extra installed):
  :func:`start_tracing` then returns a :class:`~service.ops.tracing.otel.Tracer` exporting
  OTLP/HTTP to it, sampling ``trace_sample_ratio`` of the traces that start in this process and
  following the sampled flag of those that arrive with a W3C ``traceparent``. Off, it returns
  None, and nothing imports OpenTelemetry: :mod:`service.ops.tracing.otel` is the one module
  that does, and it is imported only here, only when tracing is on (roles name its types under
  ``TYPE_CHECKING`` alone).
- The context travels as the W3C ``traceparent`` header: HTTP into the gateway, NATS headers
  from the client library to the coordinator (``submit_request``) and from the coordinator to
  the engine (a traced request leaves alone, in a routed message of its own carrying its
  header). :func:`traceparent_in` reads it from the raw NATS header block a direct handler
  gets (:mod:`service.bus.direct`), only where tracing is on.
- One request is one trace: the gateway's span, the client library's ``dpcoord.submit``, the
  coordinator's ``dpcoord.coordinator.request`` (admission, queue, route, relay) and the
  engine's ``dpcoord.engine.request`` (queue, prefill, decode). docs/protocol.md, *Tracing*.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from service.ops.tracing.otel import Tracer

TRACEPARENT = "traceparent"
_KEY = b"traceparent"


class TracingSettings(Protocol):
    """The settings tracing reads; ``service.ops.settings.Settings`` has them."""

    @property
    def otlp_endpoint(self) -> str | None: ...
    @property
    def trace_sample_ratio(self) -> float: ...


class TracingUnavailable(RuntimeError):
    """``otlp_endpoint`` is set, but OpenTelemetry is not installed."""


def start_tracing(settings: TracingSettings, service: str) -> Tracer | None:
    """A tracer for this process's role ``service`` (its ``service.name``), exporting to
    ``otlp_endpoint``; None when tracing is off."""
    if settings.otlp_endpoint is None:
        return None
    try:
        from service.ops.tracing.otel import Tracer
    except ImportError as exc:
        raise TracingUnavailable(
            f"otlp_endpoint is set but OpenTelemetry is not installed ({exc.name}): pip install 'dpcoord[otel]'"
        ) from None
    return Tracer.exporting(settings.otlp_endpoint, settings.trace_sample_ratio, service)


def traceparent_in(headers: bytes | None) -> str | None:
    """The ``traceparent`` of a raw NATS header block (``NATS/1.0\\r\\nKey: Value\\r\\n...``); None without one."""
    if not headers:
        return None
    for line in headers.split(b"\r\n")[1:]:
        key, colon, value = line.partition(b":")
        if colon and key.strip().lower() == _KEY:
            return value.strip().decode("ascii", "replace")
    return None
