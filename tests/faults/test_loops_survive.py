"""No background loop of the coordinator or the engine dies: each test makes one iteration of
one loop fail, then checks the loop still does its job and counted the failure.

Failures are injected by wrapping one method of the running service so that its first call
raises (never by mocking the bus: the NATS server is real).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.coordinator.coordinator import Coordinator
from service.coordinator.deliveries import ClientDeliveries
from service.ops.settings import Settings
from service.protocol.codec import encode_msgpack
from service.protocol.membership import EngineRegister
from tests.helpers import engines_become, request_json


class Injected(RuntimeError):
    """The failure a test injects."""


def fails_once(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, except that its first call raises :class:`Injected`."""
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise Injected("one iteration fails")
        return method(*args, **kwargs)

    return wrapper


class FlakyEvent(asyncio.Event):
    """An event whose first ``wait`` raises."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    async def wait(self) -> bool:  # type: ignore[override]
        if not self.failed:
            self.failed = True
            raise Injected("one wait fails")
        return await super().wait()


async def submit(nc: NATS, coordinator: Coordinator, prompt: str = "alive") -> dict[str, Any]:
    body = {"prompt": prompt, "sampling_params": {"max_tokens": 3}}
    return await request_json(nc, coordinator.subjects.coordinator("submit_request"), body, timeout=10)


async def test_coordinator_watchdog_survives_a_failed_round(coordinator: Coordinator, nc: NATS) -> None:
    coordinator.engines.silent_since = fails_once(coordinator.engines.silent_since)  # type: ignore[method-assign]
    await nc.request(
        coordinator.subjects.sent_by("register", "mute"), encode_msgpack(EngineRegister("mute")), timeout=5
    )
    await engines_become(coordinator, 0, timeout_s=5)  # the silent engine is still removed
    assert coordinator.counters["loop_errors_watchdog"] == 1


async def test_coordinator_heartbeat_survives_a_failed_beat(coordinator: Coordinator, nc: NATS) -> None:
    coordinator.results.sweep = fails_once(coordinator.results.sweep)  # type: ignore[method-assign]
    beats = await nc.subscribe(coordinator.subjects.coordinator("coordinator_heartbeat"))
    for _ in range(2):
        await beats.next_msg(timeout=5)
    assert coordinator.counters["loop_errors_heartbeat"] == 1


async def test_routing_task_survives_a_failed_round(settings: Settings, nc: NATS) -> None:
    coordinator = Coordinator(settings, HANDLERS)
    coordinator.requests.routed = FlakyEvent()
    async with coordinator, EngineRuntime(settings, EchoBackend()):
        await coordinator.wait_for_engines(1)
        assert (await submit(nc, coordinator))["type"] == "final"
    assert coordinator.counters["loop_errors_routing"] == 1


async def test_a_failed_background_task_is_counted_not_lost(coordinator: Coordinator) -> None:
    async def broken() -> None:
        raise Injected("a background task fails")

    coordinator.spawn(broken())
    for _ in range(3):
        await asyncio.sleep(0)
    assert coordinator.counters["task_errors"] == 1


async def test_held_replies_are_released_even_if_one_fails(nc: NATS) -> None:
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        await received.put(msg.data)

    await nc.subscribe("_INBOX.held", cb=on_msg)
    await nc.flush()
    deliveries = ClientDeliveries(nc)
    deliveries.hold()
    for held in (b"lost", b"kept"):
        await deliveries.publish("_INBOX.held", held, None)
    nc.publish = fails_once(nc.publish)  # type: ignore[method-assign]
    await deliveries.release()
    assert await asyncio.wait_for(received.get(), 5) == b"kept"
    await deliveries.publish("_INBOX.held", b"direct", None)  # open again
    assert await asyncio.wait_for(received.get(), 5) == b"direct"


async def test_engine_heartbeat_survives_a_failed_beat(coordinator: Coordinator, settings: Settings, nc: NATS) -> None:
    engine = EngineRuntime(settings, EchoBackend())
    engine.requests.ids = fails_once(engine.requests.ids)  # type: ignore[method-assign]
    async with engine:
        await asyncio.wait_for(engine.registered.wait(), 10)
        beats = await nc.subscribe(coordinator.subjects.sent_by("heartbeat", engine.engine_id))
        for _ in range(3):
            await beats.next_msg(timeout=5)
        assert engine.counters["loop_errors_heartbeat"] == 1
        assert coordinator.engines.get(engine.engine_id) is not None


async def test_engine_step_loop_survives_a_failed_iteration(
    coordinator: Coordinator, settings: Settings, nc: NATS
) -> None:
    backend = EchoBackend()
    backend.has_work = fails_once(backend.has_work)  # type: ignore[method-assign]
    async with EngineRuntime(settings, backend) as engine:
        await asyncio.wait_for(engine.registered.wait(), 10)
        assert (await submit(nc, coordinator))["generated_text"] == "ali"
        assert engine.counters["loop_errors_step"] == 1


async def test_a_step_whose_replies_fail_ends_its_requests_with_an_error(
    coordinator: Coordinator, settings: Settings, nc: NATS
) -> None:
    """Its tokens may be lost: an error, not a final with a gap in it."""
    engine = EngineRuntime(settings, EchoBackend())
    engine.requests.record_step = fails_once(engine.requests.record_step)  # type: ignore[method-assign]
    async with engine:
        await asyncio.wait_for(engine.registered.wait(), 10)
        first = await request_json(
            nc,
            coordinator.subjects.coordinator("submit_request"),
            {"prompt": "lost", "sampling_params": {"max_tokens": 3}},
        )
        assert first["type"] == "error" and first["error"]["code"] == 500
        assert (await submit(nc, coordinator))["generated_text"] == "ali"


async def test_engine_registration_survives_a_failed_attempt(coordinator: Coordinator, settings: Settings) -> None:
    engine = EngineRuntime(settings, EchoBackend())
    engine.nc.request = fails_once(engine.nc.request)  # type: ignore[method-assign]
    async with engine:
        await asyncio.wait_for(engine.registered.wait(), 10)
    assert engine.counters["loop_errors_register"] == 1
