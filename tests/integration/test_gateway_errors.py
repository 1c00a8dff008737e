"""Gateway errors in OpenAI's shape with the right HTTP statuses, 413 before any NATS traffic,
API keys, probes and metrics, and aborting at the engine when the HTTP client hangs up."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.client import DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.gateway.auth import ApiKeys
from service.gateway.errors import from_wire
from service.ops.settings import Settings
from tests.conftest import EngineFactory, make_settings
from tests.gateway_helpers import Served, http, serve_gateway, sse_data, wait_until

ECHO = "dpcoord-echo"


def sdk(served: Served, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.base_url, api_key=api_key, max_retries=0)


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (400, 400, "invalid_request_error"),
        (403, 403, "permission_error"),
        (404, 404, "not_found_error"),
        (409, 409, "conflict_error"),
        (413, 413, "invalid_request_error"),
        (429, 429, "rate_limit_error"),
        (500, 500, "internal_error"),
        (503, 503, "service_unavailable"),
        (504, 504, "timeout_error"),
        (418, 500, "internal_error"),
    ],
)
def test_wire_codes_map_to_http_statuses(code: int, status: int, kind: str) -> None:
    err = from_wire(code, "something")
    assert (err.status, err.type) == (status, kind)
    assert json.loads(err.body()) == {
        "error": {
            "message": "something",
            "type": kind,
            "param": None,
            "code": "payload_too_large" if code == 413 else None,
        }
    }
    assert err.headers() == ({"Retry-After": "1"} if status == 429 else {})


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": -1}, "frequency_penalty"),
        ("/v1/completions", {"logit_bias": {"50": 1}}, "logit_bias"),
        ("/v1/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/completions", {"top_p": 0}, "top_p"),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"not_an_openai_field": 1}, "not_an_openai_field"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
async def test_parameters_the_engines_cannot_honour_are_400_by_name(
    start_engines: EngineFactory, gateway: Served, path: str, extra: dict[str, object], param: str
) -> None:
    await start_engines(1)
    body = {"model": ECHO, "max_tokens": 2} | (
        {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    )
    response = await http(gateway.port, "POST", path, body | extra)
    assert response.status == 400, response.body
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    fine = await http(gateway.port, "POST", path, body)
    assert fine.status == 200


async def test_unknown_model_is_404_and_no_engine_is_503(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory, gateway: Served
) -> None:
    client = sdk(gateway)
    await wait_until(lambda: coordinator.peers.warmed_up)  # before, the coordinator holds: engines may be on their way
    with pytest.raises(openai.APIStatusError) as no_engine:
        await client.completions.create(model=ECHO, prompt="Hi")
    assert no_engine.value.status_code == 503
    await start_engines(1)
    with pytest.raises(openai.NotFoundError) as unknown:
        await client.completions.create(model="gpt-4", prompt="Hi")
    assert unknown.value.body == {
        "message": "model 'gpt-4' is not served by any engine (served: dpcoord-echo)",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    with pytest.raises(openai.BadRequestError) as missing:
        await client.completions.create(model="", prompt="Hi")
    assert missing.value.body["param"] == "model"  # type: ignore[index]
    await client.close()


async def test_overload_is_429_with_retry_after(nats_url: str) -> None:
    settings = make_settings(nats_url, max_inflight_per_engine=1, max_queued_requests=0)
    async with (
        Coordinator(settings, HANDLERS) as coordinator,
        serve_gateway(settings) as served,
        EngineRuntime(settings, EchoBackend(token_delay_ms=20)) as engine,
    ):
        await engine.registered.wait()
        await coordinator.wait_for_engines(1)
        client = sdk(served)
        busy = await client.completions.create(model=ECHO, prompt="Hi", max_tokens=10_000, stream=True)
        await anext(aiter(busy))  # the engine's only slot is taken
        with pytest.raises(openai.RateLimitError) as refused:
            await client.completions.create(model=ECHO, prompt="Hi")
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.body["type"] == "rate_limit_error"  # type: ignore[index]
        await busy.close()
        await client.close()


async def test_deadline_is_504(settings: Settings, coordinator: Coordinator, start_engines: EngineFactory) -> None:
    await start_engines(1, token_delay_ms=50)
    async with serve_gateway(settings.model_copy(update={"request_timeout_s": 0.3})) as served:
        client = sdk(served)
        with pytest.raises(openai.APIStatusError) as late:
            await client.completions.create(model=ECHO, prompt="Hi", max_tokens=1000)
        assert late.value.status_code == 504 and late.value.body["type"] == "timeout_error"  # type: ignore[index]
        await client.close()


async def test_a_body_over_the_limit_is_413_before_any_nats_traffic(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory, nc: NATS
) -> None:
    """The first submission NATS carries is the request sent after the refused one."""
    await start_engines(1)
    seen: asyncio.Queue[Msg] = asyncio.Queue()
    await nc.subscribe(coordinator.subjects.coordinator("submit_request"), cb=seen.put)
    await nc.flush()
    async with serve_gateway(settings.model_copy(update={"max_payload_bytes": 4096})) as served:
        big = {"model": ECHO, "prompt": "x" * 5000}
        declared = await http(served.port, "POST", "/v1/completions", big)
        assert declared.status == 413
        assert declared.json()["error"]["code"] == "payload_too_large" and "4096" in declared.json()["error"]["message"]
        small = await http(served.port, "POST", "/v1/completions", {"model": ECHO, "prompt": "after", "max_tokens": 1})
        assert small.status == 200
    first = await asyncio.wait_for(seen.get(), 5)
    assert b"after" in first.data and seen.empty()
    assert coordinator.counters["error_413"] == 0


async def test_api_keys_guard_v1_but_not_the_probes(
    settings: Settings, coordinator: Coordinator, start_engines: EngineFactory, tmp_path: Path
) -> None:
    await start_engines(1)
    key_file = tmp_path / "keys"
    key_file.write_text("# gateway keys\nk-from-file\n\n")
    keys = ApiKeys.load(["k-flag"], str(key_file))
    async with serve_gateway(settings, keys) as served:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-flag"}):
            refused = await http(served.port, "GET", "/v1/models", headers=headers)
            assert refused.status == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        for key in ("k-flag", "k-from-file"):
            client = sdk(served, api_key=key)
            assert (await client.completions.create(model=ECHO, prompt="ab", max_tokens=2)).choices[0].text == "ab"
            await client.close()
        assert (await http(served.port, "GET", "/healthz")).status == 200
        assert (await http(served.port, "GET", "/readyz")).status == 200
        metrics = await http(served.port, "GET", "/metrics")
        assert metrics.status == 200
        text = metrics.body.decode()
        assert 'dpcoord_gateway_requests_total{endpoint="completions",status="200"} 2.0' in text
        assert 'dpcoord_gateway_tokens_total{kind="completion"} 4.0' in text
        assert "dpcoord_nats_connected 1.0" in text
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.load([], str(empty))


async def test_readyz_needs_a_served_model(gateway: Served, coordinator: Coordinator) -> None:
    response = await http(gateway.port, "GET", "/readyz")
    assert response.status == 503 and b"no engine" in response.body


async def test_a_stream_whose_client_hangs_up_is_aborted_at_the_engine(
    coordinator: Coordinator, start_engines: EngineFactory, gateway: Served
) -> None:
    [engine] = await start_engines(1, token_delay_ms=20)
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    body = json.dumps({"model": ECHO, "prompt": "Hi", "max_tokens": 100_000, "stream": True}).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    received = b""
    while received.count(b"data: ") < 3:
        received += await reader.read(4096)
    assert engine.load == 1
    writer.close()
    await wait_until(lambda: engine.load == 0 and len(coordinator.requests) == 0)
    metrics = gateway.gateway.metrics
    await wait_until(lambda: metrics.in_flight == 0)  # the stream's response ends after the abort's final
    assert metrics.disconnects == 1


async def test_a_request_whose_client_hangs_up_is_aborted_at_the_engine(
    coordinator: Coordinator, start_engines: EngineFactory, gateway: Served
) -> None:
    [engine] = await start_engines(1, token_delay_ms=20)
    _, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    body = json.dumps({"model": ECHO, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100_000}).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await wait_until(lambda: engine.load == 1)
    writer.close()
    await wait_until(lambda: engine.load == 0 and len(coordinator.requests) == 0)


async def test_an_error_after_the_stream_began_is_an_event_then_done(
    coordinator: Coordinator, start_engines: EngineFactory, gateway: Served
) -> None:
    """The engine stops (control ``stop``) mid-stream: its 503 arrives as a data event, then [DONE]."""
    [engine] = await start_engines(1, token_delay_ms=20)
    stream = asyncio.ensure_future(
        http(
            gateway.port,
            "POST",
            "/v1/completions",
            {"model": ECHO, "prompt": "Hi", "max_tokens": 100_000, "stream": True},
        )
    )
    await wait_until(lambda: engine.load == 1)
    async with await DpcoordClient.connect(coordinator.settings) as admin:
        await admin.pause()
        await admin.stop()
    response = await asyncio.wait_for(stream, 10)
    events = sse_data(response.body)
    assert response.status == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
