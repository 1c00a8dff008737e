"""/healthz, /readyz, /metrics and the NATS Services API, against a running coordinator and
echo engines on the real NATS server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator

import nats.errors
import pytest
from nats.aio.client import Client as NATS
from prometheus_client.parser import text_string_to_metric_families

from engines.echo import EchoBackend
from engines.observability import engine_observability
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.bus.server import EmbeddedNatsServer, free_port
from service.cli.stack import http_ports
from service.coordinator.coordinator import Coordinator
from service.coordinator.observability import coordinator_observability
from service.ops.http_endpoints import HEALTH_PATH, METRICS_PATH, READY_PATH
from service.ops.observability import Observability
from service.ops.services_api import COORDINATOR_SERVICE, ENGINE_SERVICE
from service.ops.settings import Settings
from tests.conftest import EngineFactory, make_settings
from tests.helpers import decode_reply, engines_become, request_json


async def http_get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    """One request the way a kubelet probe or Prometheus sends it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a scrape, keyed by name and labels; parsing proves the format is valid."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(scrape: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return scrape[(name, frozenset(labels.items()))]


@pytest.fixture
async def coordinator_obs(coordinator: Coordinator) -> AsyncIterator[Observability]:
    observability = coordinator_observability(coordinator, "127.0.0.1", 0)
    await observability.start(coordinator.nc)
    yield observability
    await observability.stop()


def port_of(observability: Observability) -> int:
    assert observability.http is not None
    return observability.http.port


async def test_coordinator_ready_only_with_an_engine(
    coordinator: Coordinator, coordinator_obs: Observability, start_engines: EngineFactory
) -> None:
    port = port_of(coordinator_obs)
    assert (await http_get(port, HEALTH_PATH))[0] == 200
    status, body = await http_get(port, READY_PATH)
    assert (status, body) == (503, "not ok: no engine registered\n")

    [engine] = await start_engines(1)
    assert "1 engine(s)" in await probe_until(port, READY_PATH, 200)  # once it joined its arbitration too

    await engine.stop()
    await engines_become(coordinator, 0)
    assert (await http_get(port, READY_PATH))[0] == 503
    assert (await http_get(port, HEALTH_PATH))[0] == 200


async def probe_until(port: int, path: str, status: int, timeout_s: float = 10.0) -> str:
    """Probe the way the kubelet does, until ``status``: the connection state of the process
    under test has no event to await from outside it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got, body = await http_get(port, path)
        if got == status:
            return body
        if loop.time() > deadline:
            raise TimeoutError(f"{path} still answers {got} ({body.strip()}) after {timeout_s} s")
        await asyncio.sleep(0.02)


async def test_health_follows_the_nats_connection_and_reconnects_are_counted() -> None:
    with EmbeddedNatsServer() as server:
        async with Coordinator(make_settings(server.url), HANDLERS) as coordinator:
            observability = coordinator_observability(coordinator, "127.0.0.1", 0)
            await observability.start(coordinator.nc)
            try:
                port = port_of(observability)
                assert (await http_get(port, HEALTH_PATH))[0] == 200
                server.stop()
                assert await probe_until(port, HEALTH_PATH, 503) == "not ok: not connected to NATS\n"
                assert (await http_get(port, READY_PATH))[0] == 503
                scrape = samples((await http_get(port, METRICS_PATH))[1])
                assert value(scrape, "dpcoord_nats_connected") == 0
                server.start()
                await probe_until(port, HEALTH_PATH, 200)
                scrape = samples((await http_get(port, METRICS_PATH))[1])
                assert value(scrape, "dpcoord_nats_reconnects_total") == 1
                assert value(scrape, "dpcoord_nats_connected") == 1
            finally:
                await observability.stop()


async def test_engine_ready_once_registered(nats_url: str) -> None:
    settings = make_settings(nats_url)  # no coordinator on this prefix yet: the engine cannot register
    runtime = EngineRuntime(settings, EchoBackend())
    await runtime.start()
    observability = engine_observability(runtime, "127.0.0.1", 0)
    await observability.start(runtime.nc)
    try:
        port = port_of(observability)
        assert (await http_get(port, HEALTH_PATH))[0] == 200
        assert await http_get(port, READY_PATH) == (503, "not ok: not registered with a coordinator yet\n")
        async with Coordinator(settings, HANDLERS):
            await asyncio.wait_for(runtime.registered.wait(), 10)
            status, body = await http_get(port, READY_PATH)
            assert status == 200 and "echo backend loaded" in body
    finally:
        await observability.stop()
        await runtime.stop()


async def test_http_refuses_what_it_does_not_serve(coordinator_obs: Observability) -> None:
    port = port_of(coordinator_obs)
    assert (await http_get(port, "/nope"))[0] == 404
    assert (await http_get(port, METRICS_PATH, method="POST"))[0] == 405
    assert await http_get(port, f"{HEALTH_PATH}?verbose=1", method="HEAD") == (200, "")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"garbage\r\n\r\n")
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert raw.startswith(b"HTTP/1.1 400 ")
    assert (await http_get(port, HEALTH_PATH))[0] == 200  # still serving


async def test_metrics_count_outcomes_latency_and_engines(
    coordinator: Coordinator, coordinator_obs: Observability, start_engines: EngineFactory, nc: NATS
) -> None:
    submit = coordinator.subjects.coordinator("submit_request")
    garbage = decode_reply((await nc.request(submit, b"\xc1garbage", timeout=5)).data)
    assert garbage["error"]["code"] == 400

    [engine] = await start_engines(1, token_delay_ms=20)
    streamed = await request_json(nc, submit, {"prompt": "abc", "stream": True, "sampling_params": {"max_tokens": 2}})
    assert streamed["type"] == "partial"  # the first of the stream; the rest arrive on the same inbox
    late = await request_json(nc, submit, {"prompt": "slow", "sampling_params": {"max_tokens": 500, "timeout_s": 0.05}})
    assert late["error"]["code"] == 504
    # Undecodable control signal: the engine counts it and answers, so the count is there to scrape.
    ack = await nc.request(coordinator.subjects.broadcast("pause"), b"not msgpack", timeout=5)
    assert b"undecodable" in ack.data

    scrape = samples((await http_get(port_of(coordinator_obs), METRICS_PATH))[1])
    assert value(scrape, "dpcoord_requests_submitted_total") == 2
    assert value(scrape, "dpcoord_requests_total", outcome="failed", code="504") == 1
    assert value(scrape, "dpcoord_coordinator_events_total", event="failed_504") == 1
    assert value(scrape, "dpcoord_refused_messages_total", code="400") == 1
    assert value(scrape, "dpcoord_malformed_messages_total") == 1
    assert value(scrape, "dpcoord_engines_connected") == 1
    assert value(scrape, "dpcoord_engine_capacity", engine_id=engine.engine_id) == 256
    assert value(scrape, "dpcoord_coordinator_state", state="running") == 1
    assert value(scrape, "dpcoord_coordinator_state", state="paused") == 0
    assert value(scrape, "dpcoord_time_to_first_token_seconds_count") == 1
    assert value(scrape, "dpcoord_nats_connected") == 1
    assert value(scrape, "dpcoord_nats_reconnects_total") == 0
    # The streamed request may still be running: it is in flight on its engine or finished.
    finished = value(scrape, "dpcoord_request_duration_seconds_count")
    final = value(scrape, "dpcoord_requests_total", outcome="relayed", code="")
    in_flight = value(scrape, "dpcoord_engine_in_flight", engine_id=engine.engine_id)
    assert (finished, final, in_flight) in {(1, 0, 1), (2, 1, 0)}
    assert value(scrape, "dpcoord_requests_in_flight") == in_flight
    assert value(scrape, "dpcoord_request_duration_seconds_bucket", le="+Inf") == finished
    assert value(scrape, "dpcoord_request_duration_seconds_bucket", le="0.005") == 0  # the 504 waited 50 ms

    observability = engine_observability(engine, "127.0.0.1", 0)
    await observability.start(engine.nc)
    try:
        engine_scrape = samples((await http_get(port_of(observability), METRICS_PATH))[1])
    finally:
        await observability.stop()
    assert value(engine_scrape, "dpcoord_engine_registered") == 1
    assert value(engine_scrape, "dpcoord_engine_paused") == 0
    assert value(engine_scrape, "dpcoord_malformed_messages_total") == 1
    assert value(engine_scrape, "dpcoord_nats_connected") == 1


async def collect_replies(nc: NATS, subject: str, wanted: set[str], timeout_s: float = 5.0) -> dict[str, dict]:
    """What `nats micro ls` does: one request to $SRV.<verb>, every service answers; keep
    the answers of the instances we started (other tests' services may answer too)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    found: dict[str, dict] = {}
    others: list[str] = []
    try:
        await nc.publish(subject, b"", reply=inbox)
        while not wanted <= found.keys():
            try:
                reply = json.loads((await sub.next_msg(timeout=timeout_s)).data)
            except nats.errors.TimeoutError:
                raise AssertionError(f"{subject}: no answer from {wanted - found.keys()}; others: {others}") from None
            instance = reply["metadata"]["instance_id"]
            if instance in wanted:
                found[instance] = reply
            else:
                others.append(instance)
    finally:
        await sub.unsubscribe()
    return found


async def test_nats_micro_lists_coordinator_and_engines(
    coordinator: Coordinator, coordinator_obs: Observability, start_engines: EngineFactory, nc: NATS
) -> None:
    [engine] = await start_engines(1)
    observability = engine_observability(engine, "127.0.0.1", None)
    await observability.start(engine.nc)
    try:
        ids = {coordinator.id, engine.engine_id}
        pings = await collect_replies(nc, "$SRV.PING", ids)
        assert pings[coordinator.id]["name"] == COORDINATOR_SERVICE
        assert pings[engine.engine_id]["name"] == ENGINE_SERVICE
        assert pings[coordinator.id]["type"] == "io.nats.micro.v1.ping_response"

        info = (await collect_replies(nc, f"$SRV.INFO.{COORDINATOR_SERVICE}", {coordinator.id}))[coordinator.id]
        [endpoint] = info["endpoints"]
        assert endpoint["subject"] == coordinator.subjects.status("coordinator", coordinator.id)

        stats = (await collect_replies(nc, f"$SRV.STATS.{ENGINE_SERVICE}", {engine.engine_id}))[engine.engine_id]
        assert stats["endpoints"][0]["data"]["registered"] is True

        status = await request_json(nc, endpoint["subject"], {})
        assert status["state"] == "running"
        assert status["engines"] == [
            {"engine_id": engine.engine_id, "in_flight": 0, "capacity": 256, "model": "dpcoord-echo"}
        ]

        # The service answers on its own subjects; the coordinator keeps serving its own.
        reply = await request_json(nc, coordinator.subjects.coordinator("submit_request"), {"prompt": "ok"})
        assert reply["type"] == "final"
    finally:
        await observability.stop()


async def wait_for_lines(process: asyncio.subprocess.Process, *texts: str, timeout_s: float = 20.0) -> None:
    """Read a child's log until it has logged a line containing each of ``texts``, in any order."""
    assert process.stderr is not None
    stderr = process.stderr
    missing = set(texts)

    async def read() -> None:
        while missing:
            line = (await stderr.readline()).decode()
            if not line:
                raise AssertionError(f"process exited ({await process.wait()}) before logging {missing}")
            missing.difference_update({text for text in missing if text in line})

    await asyncio.wait_for(read(), timeout_s)


async def test_cli_services_serve_probes_on_their_configured_ports(nats_url: str) -> None:
    """`dpcoord coordinator` and `dpcoord engine` as the chart runs them: settings from DPCOORD_ env."""
    settings = make_settings(nats_url)
    ports = {"coordinator": free_port(), "engine": free_port()}
    env = os.environ | {
        "DPCOORD_NATS_URL": nats_url,
        "DPCOORD_SUBJECT_PREFIX": settings.subject_prefix,
        "DPCOORD_HTTP_HOST": "127.0.0.1",
    }
    processes = {
        role: await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "service",
            role,
            env=env | {"DPCOORD_HTTP_PORT": str(port)},
            stderr=asyncio.subprocess.PIPE,
        )
        for role, port in ports.items()
    }
    try:
        await wait_for_lines(processes["coordinator"], f"health and metrics on http://127.0.0.1:{ports['coordinator']}")
        await wait_for_lines(
            processes["engine"], "registered NATS service dpcoord-engine", "registered with coordinator"
        )
        for port in ports.values():
            assert (await http_get(port, HEALTH_PATH))[0] == 200
            await probe_until(port, READY_PATH, 200)  # the coordinator joins its arbitration first
        assert "dpcoord_engines_connected 1.0" in (await http_get(ports["coordinator"], METRICS_PATH))[1]
    finally:
        for process in processes.values():
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        codes = [await asyncio.wait_for(process.wait(), 20) for process in processes.values()]
    assert codes == [0, 0]


def test_up_gives_each_process_its_own_http_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dpcoord up` runs a coordinator and engines on one host: free ports unless told otherwise."""
    monkeypatch.delenv("DPCOORD_HTTP_PORT")
    free = http_ports(Settings(), engines=2)
    assert len(set(free)) == 3 and all(free)
    assert http_ports(Settings(http_port=9000), engines=2) == [9000, 9001, 9002]
    assert http_ports(Settings(http_port=0), engines=2) == [0, 0, 0]
