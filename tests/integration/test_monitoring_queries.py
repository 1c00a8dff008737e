"""The chart's dashboard, alerts and KEDA trigger read only what the services export: every PromQL
expression they render names metrics, and selects and groups by labels, found on the live
/metrics of a coordinator, an echo engine, a torch engine and a gateway, after traffic through
each (a family with a label shows no sample, so no label, until it counted something). The metrics added for them are checked on the way: tokens generated, the inter-token
histogram, requests waiting in an engine and in the coordinator's queue."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from helm_python import Chart
from nats.aio.client import Client as NATS
from prometheus_client.parser import text_string_to_metric_families

from engines.factory import torch_options
from engines.observability import engine_observability
from engines.runtime import EngineRuntime
from engines.torch_backend.backend import TorchBackend
from service.client import DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.coordinator.observability import coordinator_observability
from service.ops.http_endpoints import METRICS_PATH
from service.ops.observability import Observability
from service.ops.settings import Settings
from service.protocol.subjects import Header
from tests.chart.contract import CHART
from tests.chart.monitoring import MONITORING_VALUES, TARGET_LABELS, queries
from tests.chart.promql import reads
from tests.chart.render import render_objects
from tests.conftest import EngineFactory
from tests.gateway_helpers import Served, http, sse_data
from tests.helpers import decode_reply, request_json
from tests.integration.test_observability import http_get, port_of

# Sample name -> the label names its samples carry.
Exported = dict[str, set[str]]


def exported(text: str) -> Exported:
    """Every sample name of a scrape with its label names; parsing proves the format is valid."""
    found: Exported = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return found


def value(text: str, name: str) -> float:
    [found] = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return found


@pytest.fixture
async def torch_engine(settings: Settings, coordinator: Coordinator) -> AsyncIterator[EngineRuntime]:
    """The random default model on CPU: the prefix-cache metrics come from its KV cache."""
    engine_settings = settings.model_copy(
        update={"backend": "torch", "device": "cpu", "max_context": 128, "kv_cache_gb": 0.005}
    )
    engine = EngineRuntime(engine_settings, TorchBackend(torch_options(engine_settings)))
    await engine.start()
    await asyncio.wait_for(engine.registered.wait(), 30)
    yield engine
    await engine.stop()


@pytest.fixture
async def coordinator_metrics(coordinator: Coordinator) -> AsyncIterator[Observability]:
    observability = coordinator_observability(coordinator, "127.0.0.1", 0)
    await observability.start(coordinator.nc)
    yield observability
    await observability.stop()


async def engine_scrape(engine: EngineRuntime) -> str:
    observability = engine_observability(engine, "127.0.0.1", 0)
    await observability.start(engine.nc)
    try:
        return (await http_get(port_of(observability), METRICS_PATH))[1]
    finally:
        await observability.stop()


async def coordinator_queue_reaches(port: int, queued: float, timeout_s: float = 10.0) -> str:
    """Scrape until the coordinator reports ``queued`` requests, as Prometheus would see it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        text = (await http_get(port, METRICS_PATH))[1]
        if value(text, "dpcoord_requests_queued") == queued:
            return text
        if loop.time() > deadline:
            raise TimeoutError(f"dpcoord_requests_queued never became {queued}")
        await asyncio.sleep(0.02)


async def test_every_query_reads_exported_metrics(
    coordinator: Coordinator,
    coordinator_metrics: Observability,
    start_engines: EngineFactory,
    torch_engine: EngineRuntime,
    gateway: Served,
    settings: Settings,
    nc: NATS,
) -> None:
    [echo] = await start_engines(1)
    port = port_of(coordinator_metrics)
    # A stream through the gateway (TTFT, HTTP status and usage) and one straight to the torch engine.
    streamed = await http(
        gateway.port,
        "POST",
        "/v1/completions",
        {"model": "dpcoord-echo", "prompt": "abcdefgh", "max_tokens": 8, "stream": True},
    )
    assert streamed.status == 200 and sse_data(streamed.body)[-1] == "[DONE]"
    async with await DpcoordClient.connect(settings, nc=nc) as client:
        final = await client.submit("Hello", max_tokens=6, model="dpcoord-random", timeout=30)
    assert len(final.generated_tokens) == 6

    garbage = await nc.request(coordinator.subjects.coordinator(Header.SUBMIT_REQUEST), b"\xc1", timeout=5)
    assert decode_reply(garbage.data)["error"]["code"] == 400  # refused: dpcoord_refused_messages_total{code}

    # A submission held by a pause waits in the coordinator's queue.
    pause = await request_json(nc, coordinator.subjects.coordinator(Header.PAUSE), {})
    assert pause["type"] == "ack"
    inbox = nc.new_inbox()
    held = await nc.subscribe(inbox)
    body = {"prompt": "x", "sampling_params": {"max_tokens": 1}, "model": "dpcoord-echo"}
    await nc.publish(coordinator.subjects.coordinator(Header.SUBMIT_REQUEST), json.dumps(body).encode(), reply=inbox)
    coordinator_text = await coordinator_queue_reaches(port, 1)
    await request_json(nc, coordinator.subjects.coordinator(Header.UNPAUSE), {})
    assert json.loads((await held.next_msg(timeout=10)).data)["type"] == "final"
    await coordinator_queue_reaches(port, 0)

    echo_text, torch_text = await engine_scrape(echo), await engine_scrape(torch_engine)
    gateway_text = (await http(gateway.port, "GET", METRICS_PATH)).body.decode()
    for text, tokens in ((echo_text, 9), (torch_text, 6)):  # the held request's token is echo's ninth
        assert value(text, "dpcoord_engine_generated_tokens_total") == tokens
        assert value(text, "dpcoord_engine_waiting_requests") == 0
    # One gap per token after each request's first: 7 + 0 for echo, 5 for torch.
    assert value(echo_text, "dpcoord_engine_inter_token_seconds_count") == 7
    assert value(torch_text, "dpcoord_engine_inter_token_seconds_count") == 5
    assert value(coordinator_text, "dpcoord_engines_silent_total") == 0

    everything: Exported = {}
    for text in (coordinator_text, echo_text, torch_text, gateway_text):
        for name, labels in exported(text).items():
            everything.setdefault(name, set()).update(labels)
    with Chart.load(CHART) as chart:
        rendered = queries(render_objects(chart, MONITORING_VALUES, "rel", "llm"))
    assert len(rendered) > 30
    problems = [
        problem for where, expression in rendered.items() for problem in unexported(where, expression, everything)
    ]
    assert not problems, "\n".join(problems)


def unexported(where: str, expression: str, everything: Exported) -> list[str]:
    """What ``expression`` reads that no scrape carries (metrics, or labels besides the scrape's own)."""
    found = reads(expression)
    problems = [f"{where}: no service exports {name}" for name in sorted(found.metrics - everything.keys())]
    available: set[str] = set(TARGET_LABELS)
    for name, labels in found.selectors.items():
        carried = everything.get(name, set()) | TARGET_LABELS
        available |= carried
        problems += [f"{where}: {name} has no label {label}" for label in sorted(labels - carried)]
    problems += [f"{where}: no metric it reads has label {label}" for label in sorted(found.grouped_by - available)]
    return problems


def test_the_check_fails_on_a_misspelt_metric_or_label() -> None:
    everything: dict[str, Any] = {"dpcoord_requests_total": {"outcome", "code"}}
    assert unexported("x", 'sum by (code) (rate(dpcoord_requests_total{namespace="a"}[5m]))', everything) == []
    assert unexported("x", "sum(dpcoord_request_total)", everything) == ["x: no service exports dpcoord_request_total"]
    assert unexported("x", 'sum(dpcoord_requests_total{outcom="failed"})', everything) == [
        "x: dpcoord_requests_total has no label outcom"
    ]
    assert unexported("x", "sum by (engine) (dpcoord_requests_total)", everything) == [
        "x: no metric it reads has label engine"
    ]
