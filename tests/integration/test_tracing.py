"""Tracing with OpenTelemetry (service/ops/tracing, docs/protocol.md *Tracing*): one request is
one trace across the gateway, the client library, a coordinator and an engine, each with its own
tracer and the SDK's in-memory exporter, as each process has its own; with tracing off nothing
imports OpenTelemetry."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.client import DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.ops.tracing.otel import Tracer
from tests.gateway_helpers import http, serve_gateway

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
HTTP_PARENT = "00f067aa0ba902b7"


class Recorded:
    """One role's tracer, exporting to memory (a test double of a collector)."""

    def __init__(self, service: str, sample_ratio: float = 1.0) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer = Tracer(service, self.exporter, sample_ratio)

    def spans(self) -> Sequence[ReadableSpan]:
        self.tracer.flush()
        return self.exporter.get_finished_spans()


@asynccontextmanager
async def traced_fleet(settings: Settings, coordinator: Recorded, engine: Recorded) -> AsyncIterator[None]:
    async with Coordinator(settings, HANDLERS, tracer=coordinator.tracer):
        runtime = EngineRuntime(settings, EchoBackend(), tracer=engine.tracer)
        await runtime.start()
        try:
            await asyncio.wait_for(runtime.registered.wait(), 10)
            yield
        finally:
            await runtime.stop()


def by_name(spans: Sequence[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


def parent_of(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def listing(spans: Sequence[ReadableSpan]) -> str:
    """The trace as docs and notes show it: each span under its parent, with its service and duration."""
    children: dict[int | None, list[ReadableSpan]] = {}
    for span in sorted(spans, key=lambda span: span.start_time or 0):
        children.setdefault(parent_of(span), []).append(span)
    ids = {span.context.span_id for span in spans}
    lines: list[str] = []

    def walk(span: ReadableSpan, depth: int) -> None:
        service = str(span.resource.attributes["service.name"])
        duration_ms = ((span.end_time or 0) - (span.start_time or 0)) / 1e6
        lines.append(f"{'  ' * depth}{span.name} [{service}] {duration_ms:.3f} ms {dict(span.attributes or {})}")
        for child in children.get(span.context.span_id, []):
            walk(child, depth + 1)

    for root in [span for span in spans if parent_of(span) not in ids]:
        walk(root, 0)
    return "\n".join(lines)


async def test_one_request_is_one_trace_from_the_http_client_to_the_engine(settings: Settings) -> None:
    gateway, coordinator, engine = (
        Recorded("dpcoord-gateway"),
        Recorded("dpcoord-coordinator"),
        Recorded("dpcoord-engine"),
    )
    async with traced_fleet(settings, coordinator, engine), serve_gateway(settings, tracer=gateway.tracer) as served:
        response = await http(
            served.port,
            "POST",
            "/v1/completions",
            {"model": "dpcoord-echo", "prompt": "hello", "max_tokens": 4},
            headers={"traceparent": f"00-{TRACE_ID}-{HTTP_PARENT}-01"},
        )
    assert response.status == 200
    spans = [*gateway.spans(), *coordinator.spans(), *engine.spans()]
    print(listing(spans))  # the trace docs/protocol.md shows
    assert {f"{span.context.trace_id:032x}" for span in spans} == {TRACE_ID}
    named = by_name(spans)
    assert set(named) == {
        "POST /v1/completions",
        "dpcoord.submit",
        "dpcoord.coordinator.request",
        "dpcoord.coordinator.admission",
        "dpcoord.coordinator.queue",
        "dpcoord.coordinator.route",
        "dpcoord.coordinator.relay",
        "dpcoord.engine.request",
        "dpcoord.engine.queue",
        "dpcoord.engine.prefill",
        "dpcoord.engine.decode",
    }
    chain = [
        ("POST /v1/completions", int(HTTP_PARENT, 16)),
        ("dpcoord.submit", named["POST /v1/completions"].context.span_id),
        ("dpcoord.coordinator.request", named["dpcoord.submit"].context.span_id),
        ("dpcoord.coordinator.route", named["dpcoord.coordinator.request"].context.span_id),
        ("dpcoord.coordinator.relay", named["dpcoord.coordinator.request"].context.span_id),
        ("dpcoord.engine.request", named["dpcoord.coordinator.route"].context.span_id),
        ("dpcoord.engine.prefill", named["dpcoord.engine.request"].context.span_id),
        ("dpcoord.engine.decode", named["dpcoord.engine.request"].context.span_id),
    ]
    assert [(name, parent_of(named[name])) for name, _ in chain] == chain
    request_id = named["dpcoord.coordinator.request"].attributes["dpcoord.request_id"]  # type: ignore[index]
    engine_span = named["dpcoord.engine.request"].attributes or {}
    assert engine_span["dpcoord.request_id"] == request_id
    assert engine_span["gen_ai.request.model"] == "dpcoord-echo"
    assert engine_span["gen_ai.usage.input_tokens"] == 5 and engine_span["gen_ai.usage.output_tokens"] == 4
    assert tuple(engine_span["gen_ai.response.finish_reasons"]) == ("length",)  # type: ignore[arg-type]
    submit = named["dpcoord.submit"].attributes or {}
    assert (
        submit["dpcoord.request_id"] == request_id and submit["dpcoord.engine_id"] == engine_span["dpcoord.engine_id"]
    )
    assert named["POST /v1/completions"].attributes["http.response.status_code"] == 200  # type: ignore[index]
    services = {span.name: span.resource.attributes["service.name"] for span in spans}
    assert services["dpcoord.submit"] == "dpcoord-gateway"  # the gateway's client library shares its tracer
    assert services["dpcoord.engine.decode"] == "dpcoord-engine"


async def test_a_trace_not_sampled_where_it_starts_is_traced_nowhere(settings: Settings) -> None:
    client_side, coordinator, engine = Recorded("dpcoord-client", 0.0), Recorded("c"), Recorded("e")
    async with traced_fleet(settings, coordinator, engine):
        async with await DpcoordClient.connect(settings, tracer=client_side.tracer) as client:
            final = await client.submit("hi", max_tokens=2)
    assert final.finish_reason == "length"
    assert [*client_side.spans(), *coordinator.spans(), *engine.spans()] == []


async def test_a_submission_without_a_traceparent_starts_its_trace_at_the_coordinator(settings: Settings) -> None:
    coordinator, engine = Recorded("dpcoord-coordinator"), Recorded("dpcoord-engine")
    async with traced_fleet(settings, coordinator, engine):
        async with await DpcoordClient.connect(settings) as client:  # tracing off here: no headers
            await asyncio.gather(*(client.submit(f"p{index}", max_tokens=2) for index in range(3)))
    requests = [span for span in coordinator.spans() if span.name == "dpcoord.coordinator.request"]
    engine_requests = [span for span in engine.spans() if span.name == "dpcoord.engine.request"]
    assert len(requests) == 3 and all(span.parent is None for span in requests)
    assert {span.context.trace_id for span in engine_requests} == {span.context.trace_id for span in requests}


def test_with_tracing_off_nothing_imports_opentelemetry() -> None:
    script = (
        "import sys\n"
        "import service.cli.main, service.coordinator.coordinator, service.gateway.app, engines.runtime, service.client\n"
        "from service.ops.settings import Settings\n"
        "from service.ops.tracing import start_tracing\n"
        "assert start_tracing(Settings(), 'dpcoord-coordinator') is None\n"
        "print(sorted(name for name in sys.modules if name.startswith('opentelemetry')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


async def test_a_stream_s_span_ends_with_its_final_or_when_its_reader_stops(settings: Settings) -> None:
    client_side, coordinator, engine = Recorded("dpcoord-client"), Recorded("c"), Recorded("e")
    async with traced_fleet(settings, coordinator, engine):
        async with await DpcoordClient.connect(settings, tracer=client_side.tracer) as client:
            replies = [reply async for reply in client.stream("hello", max_tokens=3)]
            async with aclosing(client.stream("abandoned", max_tokens=50)) as stream:
                await anext(stream)  # the reader stops after one reply
    submits = [span for span in client_side.spans() if span.name == "dpcoord.submit"]
    assert len(submits) == 2 and all(span.end_time for span in submits)
    finished = next(span for span in submits if span.attributes and "dpcoord.request_id" in span.attributes)
    assert finished.attributes["gen_ai.usage.output_tokens"] == len(replies[-1].generated_tokens) == 3  # type: ignore[index,union-attr]
