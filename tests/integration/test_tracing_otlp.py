"""Tracing exported as operators run it: ``otlp_endpoint`` set in the settings of a client, a
coordinator and an engine, each exporting OTLP/HTTP (protobuf) to a collector; here a local
receiver this test starts, which decodes what it is sent with OpenTelemetry's own protobuf
types (a test double of an OpenTelemetry Collector)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the otel extra is not installed")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.client import DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings

Received = list[tuple[str, str, bytes]]  # (service.name, span name, trace id)


@pytest.fixture
def collector() -> Iterator[tuple[str, Received]]:
    """A receiver of OTLP/HTTP protobuf on 127.0.0.1: its base URL, and the spans it received."""
    received: Received = []
    paths: list[str] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            paths.append(self.path)
            request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
            for resource_spans in request.resource_spans:
                service = next(
                    attribute.value.string_value
                    for attribute in resource_spans.resource.attributes
                    if attribute.key == "service.name"
                )
                for scope_spans in resource_spans.scope_spans:
                    received.extend((service, span.name, span.trace_id) for span in scope_spans.spans)
            body = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        assert set(paths) <= {"/v1/traces"}


async def test_spans_of_one_request_reach_the_collector_from_every_process(
    settings: Settings, collector: tuple[str, Received]
) -> None:
    endpoint, received = collector
    traced = settings.model_copy(update={"otlp_endpoint": endpoint})
    async with Coordinator(traced, HANDLERS) as coordinator:
        engine = EngineRuntime(traced, EchoBackend())
        await engine.start()
        try:
            await asyncio.wait_for(engine.registered.wait(), 10)
            async with await DpcoordClient.connect(traced) as client:
                final = await client.submit("hello", max_tokens=3)
        finally:
            await engine.stop()  # each closes its tracer, which exports what is left
        assert coordinator.tracer is not None
    assert final.finish_reason == "length"
    services = {service for service, _, _ in received}
    assert services == {"dpcoord-client", "dpcoord-coordinator", "dpcoord-engine"}
    assert len({trace_id for _, _, trace_id in received}) == 1
    names = {name for _, name, _ in received}
    assert {"dpcoord.submit", "dpcoord.coordinator.request", "dpcoord.engine.decode"} <= names
