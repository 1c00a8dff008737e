"""OpenTelemetry behind dpcoord's tracing: the one module that imports it (the ``otel`` extra),
imported only when tracing is on (:func:`service.ops.tracing.start_tracing`).

A :class:`Tracer` is one process role's (``service.name``: dpcoord-gateway, dpcoord-client,
dpcoord-coordinator, dpcoord-engine), with its own provider, so several roles in one process
(tests, ``dpcoord up`` children apart) keep their spans apart. Each role asks it for the spans
of its part of a request, in the words of that role (docs/protocol.md, *Tracing*, lists them).
Where a part is timed on the hot path with ``time.monotonic()`` readings (the coordinator's
queue, the engine's steps), its spans are made afterwards from them (:func:`wall_ns`), so no span
object is held per step. Spans are exported in batches by a background thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from service.protocol.messages import Final

Attributes = Mapping[str, str | int | float | bool | Sequence[str]]
_propagator = TraceContextTextMapPropagator()


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as OpenTelemetry's nanoseconds since the epoch."""
    return time.time_ns() - time.monotonic_ns() + int(monotonic_s * 1e9)


def _parent(traceparent: str | None) -> Context | None:
    return None if traceparent is None else _propagator.extract({"traceparent": traceparent})


def _traceparent(span: Span) -> str:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier["traceparent"]


def _fail(span: Span, code: int, message: str) -> None:
    span.set_attribute("dpcoord.error_code", code)
    span.set_status(Status(StatusCode.ERROR, message))


class Tracer:
    def __init__(self, service: str, exporter: SpanExporter, sample_ratio: float = 1.0) -> None:
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": service}), sampler=ParentBased(TraceIdRatioBased(sample_ratio))
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("dpcoord")

    @classmethod
    def exporting(cls, endpoint: str, sample_ratio: float, service: str) -> Tracer:
        """Spans to the OTLP/HTTP collector at ``endpoint`` (its ``/v1/traces``), protobuf-encoded."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(service, OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces"), sample_ratio)

    def flush(self) -> None:
        """Export every span ended so far."""
        self._provider.force_flush()

    def close(self) -> None:
        """Export what is left and stop; safe twice."""
        self._provider.shutdown()

    def span_at(
        self,
        name: str,
        parent: Context | None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes | None = None,
        start_ns: int | None = None,
    ) -> Span:
        return self._tracer.start_span(name, parent, kind, attributes, start_time=start_ns)

    def timed(self, name: str, parent: Span, start_ns: int, end_ns: int, attributes: Attributes | None = None) -> None:
        """A child span of ``parent`` over ``[start_ns, end_ns]``, made afterwards."""
        self.span_at(name, trace.set_span_in_context(parent), attributes=attributes, start_ns=start_ns).end(end_ns)

    # ------------------------------------------------------------ the gateway

    @contextmanager
    def http_request(self, method: str, path: str, traceparent: str | None) -> Iterator[HttpSpan]:
        """The gateway's span of one HTTP request, continuing the client's ``traceparent``; the
        current span inside the block, so the client library's submissions are its children."""
        attributes = {"http.request.method": method, "url.path": path}
        with self._tracer.start_as_current_span(
            f"{method} {path}", _parent(traceparent), SpanKind.SERVER, attributes
        ) as span:
            yield HttpSpan(span)

    # ------------------------------------------------------------ the client library

    def submit(self, subject: str, client_request_id: str | int, model: str | None, stream: bool) -> SubmitSpan:
        """The client library's span of one submission, a child of the current span (the
        gateway's, in the gateway); its ``traceparent`` goes in the submission's NATS headers,
        sampled or not, so the coordinator and the engine follow its decision."""
        attributes: dict[str, str | int | bool] = {
            "messaging.system": "nats",
            "messaging.destination.name": subject,
            "dpcoord.client_request_id": client_request_id,
            "dpcoord.stream": stream,
        }
        if model is not None:
            attributes["gen_ai.request.model"] = model
        return SubmitSpan(self.span_at("dpcoord.submit", None, SpanKind.PRODUCER, attributes))

    # ------------------------------------------------------------ the coordinator

    def coordinator_request(self, traceparent: str | None, started_ns: int) -> CoordinatorTrace | None:
        """The coordinator's span of one accepted request, from ``started_ns`` (when admission
        began); None when the trace is not sampled."""
        span = self.span_at("dpcoord.coordinator.request", _parent(traceparent), SpanKind.CONSUMER, start_ns=started_ns)
        if not span.is_recording():
            return None
        return CoordinatorTrace(self, span, started_ns)

    # ------------------------------------------------------------ the engine

    def engine_request(self, traceparent: str, attributes: Attributes) -> EngineTrace | None:
        """The context of one routed request's spans, made when it leaves (:meth:`EngineTrace.left`);
        None when the coordinator's trace is not sampled."""
        parent = _parent(traceparent)
        if parent is None or not trace.get_current_span(parent).get_span_context().trace_flags.sampled:
            return None
        return EngineTrace(self, parent, attributes)


class HttpSpan:
    def __init__(self, span: Span) -> None:
        self._span = span

    def answered(self, status: int) -> None:
        self._span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self._span.set_status(Status(StatusCode.ERROR))


class SubmitSpan:
    def __init__(self, span: Span) -> None:
        self._span = span
        self._open = True
        self.headers = {"traceparent": _traceparent(span)}  # the NATS headers of every publish of it

    def finished(self, final: Final) -> None:
        span = self._span
        span.set_attribute("dpcoord.request_id", final.request_id)
        if final.engine_id is not None:
            span.set_attribute("dpcoord.engine_id", final.engine_id)
        if final.prompt_tokens is not None:
            span.set_attribute("gen_ai.usage.input_tokens", final.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", len(final.generated_tokens))
        span.set_attribute("gen_ai.response.finish_reasons", [final.finish_reason])
        self.close()

    def failed(self, code: int, message: str) -> None:
        if self._open:
            _fail(self._span, code, message)
        self.close()

    def close(self) -> None:
        """End it (once): after its final, its error, or when its reader stopped reading."""
        if self._open:
            self._open = False
            self._span.end()


class CoordinatorTrace:
    """One request's spans in the coordinator: the request span, and its admission, queue,
    route (one per run) and relay children."""

    def __init__(self, tracer: Tracer, span: Span, started_ns: int) -> None:
        self._tracer = tracer
        self._span = span
        self._started_ns = started_ns
        self._route: Span | None = None
        self._final_ns = 0

    def admitted(self, request_id: str, coordinator_id: str, model: str | None, queued: bool, at_ns: int) -> None:
        """Admission ended at ``at_ns``: the admission span, and the request's attributes."""
        span = self._span
        span.set_attribute("dpcoord.request_id", request_id)
        span.set_attribute("dpcoord.coordinator_id", coordinator_id)
        if model is not None:
            span.set_attribute("gen_ai.request.model", model)
        self._tracer.timed("dpcoord.coordinator.admission", span, self._started_ns, at_ns, {"dpcoord.queued": queued})

    def routed(self, engine_id: str, attempt: int, admitted_at: float, routed_at: float) -> str:
        """The queue span of the first run (from ``admitted_at`` to ``routed_at``, monotonic) and
        the route span of this run, open until :meth:`sent`; returns the ``traceparent`` the
        engine continues."""
        span, tracer = self._span, self._tracer
        span.set_attribute("dpcoord.engine_id", engine_id)
        routed_ns = wall_ns(routed_at)
        if attempt == 0:
            tracer.timed("dpcoord.coordinator.queue", span, wall_ns(admitted_at), routed_ns)
        attributes: dict[str, str | int] = {"dpcoord.engine_id": engine_id, "dpcoord.attempt": attempt}
        route = self._route = tracer.span_at(
            "dpcoord.coordinator.route", trace.set_span_in_context(span), SpanKind.PRODUCER, attributes, routed_ns
        )
        return _traceparent(route)

    def sent(self) -> None:
        """The routed message left for its engine."""
        if self._route is not None:
            self._route.end()
            self._route = None

    def final_arrived(self) -> None:
        self._final_ns = time.time_ns()

    def failed(self, code: int, message: str) -> None:
        _fail(self._span, code, message)

    def answered(self) -> None:
        """The terminal reply left for the client: the relay span (from the engine's final on) and the request span end."""
        self.sent()
        if self._final_ns:
            self._tracer.timed("dpcoord.coordinator.relay", self._span, self._final_ns, time.time_ns())
        self._span.end()


class EngineTrace:
    def __init__(self, tracer: Tracer, parent: Context, attributes: Attributes) -> None:
        self._tracer = tracer
        self._parent = parent
        self._attributes = attributes

    def left(
        self,
        attributes: Attributes,
        arrived: float,
        first_step: float,
        first_token: float,
        ended: float,
        error: tuple[int, str] | None = None,
    ) -> None:
        """The request span over ``[arrived, ended]`` and its queue (until ``first_step``, the
        step that prefilled it), prefill (until ``first_token``) and decode children, from
        monotonic readings (0: it never got that far)."""
        tracer = self._tracer
        span = tracer.span_at(
            "dpcoord.engine.request",
            self._parent,
            SpanKind.CONSUMER,
            {**self._attributes, **attributes},
            wall_ns(arrived),
        )
        if error is not None:
            _fail(span, *error)
        end_ns = wall_ns(ended)
        if not first_step:
            tracer.timed("dpcoord.engine.queue", span, wall_ns(arrived), end_ns)
        else:
            step_ns = wall_ns(first_step)
            tracer.timed("dpcoord.engine.queue", span, wall_ns(arrived), step_ns)
            token_ns = wall_ns(first_token)
            tracer.timed("dpcoord.engine.prefill", span, step_ns, token_ns)
            tracer.timed("dpcoord.engine.decode", span, token_ns, end_ns)
        span.end(end_ns)
