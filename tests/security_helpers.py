"""What the security tests under docs/nats-server.example.conf share: the role users and their
passwords, settings that log in as a role, a raw connection that records the permissions
violations NATS reports, and a coordinator with one echo engine (a fleet) on that server.

The fixtures (``server_env``, ``secured_nats``, ``fleet``) are made available to every
integration test by tests/integration/conftest.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from nats.aio.client import Client as NATS

from engines.echo import EchoBackend
from engines.runtime import EngineRuntime
from handlers import HANDLERS
from service.bus.connection import connect_nats
from service.bus.server import EmbeddedNatsServer
from service.client import DpcoordClient
from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from service.protocol.state import CoordinatorState
from tests.conftest import make_settings
from tests.helpers import REPO_ROOT

EXAMPLE_CONFIG = REPO_ROOT / "docs" / "nats-server.example.conf"
PREFIX = "dpcoord"  # the prefix the example config grants
ROLES = ("coordinator", "engine", "admin", "client", "gateway")
PASSWORDS = {role: f"{role}-test-password" for role in ROLES}
# What the server is given: bcrypt hashes for two roles (bcrypt.hashpw(password, bcrypt.gensalt(10))),
# plain text for the others; the example config takes either.
SERVER_PASSWORDS = {
    "coordinator": PASSWORDS["coordinator"],
    "engine": PASSWORDS["engine"],
    "admin": "$2b$10$b4IP.sYixzbnCkcZShVCCe9IvdHbsXLorwyrtMlxYnJXGBXYApoNW",
    "client": "$2b$10$BIkP7aobPsVsTMWwkPZsUOwNgpkHUQKf9lJh8WUl1uuCCjVq002iS",
    "gateway": PASSWORDS["gateway"],
}


def role_settings(nats_url: str, role: str, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "subject_prefix": PREFIX,
        "nats_user": role,
        "nats_password": PASSWORDS[role],
        "nats_inbox_prefix": f"_INBOX_{role}",
    }
    values.update(overrides)
    return make_settings(nats_url, **values)


class Violations:
    """Permissions violations NATS reported to one connection's error callback."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self._changed = asyncio.Event()

    async def record(self, exc: Exception) -> None:
        self.errors.append(str(exc).lower())
        self._changed.set()

    async def wait_for(self, operation: str, subject: str, timeout: float = 5.0) -> None:
        needle = f'permissions violation for {operation} to "{subject.lower()}"'

        async def seen() -> None:
            while not any(needle in error for error in self.errors):
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(seen(), timeout)


@asynccontextmanager
async def connected(settings: Settings) -> AsyncIterator[tuple[NATS, Violations]]:
    """A raw connection made from settings, the way dpcoord connects, with its violations."""
    violations = Violations()
    nc = await connect_nats(settings, name="security-probe", on_error=violations.record)
    try:
        yield nc, violations
    finally:
        await nc.close()


@pytest.fixture
def server_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # NATS reads an environment variable as a config value: quoted, as the config file says.
    for role, password in SERVER_PASSWORDS.items():
        monkeypatch.setenv(f"NATS_PASSWORD_{role.upper()}", f'"{password}"')


@pytest.fixture
def secured_nats(server_env: None) -> Iterator[EmbeddedNatsServer]:
    with EmbeddedNatsServer(extra_args=("-c", str(EXAMPLE_CONFIG))) as server:
        yield server


@dataclass
class Fleet:
    url: str
    coordinator: Coordinator
    engine: EngineRuntime


@asynccontextmanager
async def running_fleet(
    coordinator_settings: Settings, engine_settings: Settings, url: str, token_delay_ms: float = 0.0
) -> AsyncIterator[Fleet]:
    async with Coordinator(coordinator_settings, HANDLERS) as coordinator:
        engine = EngineRuntime(engine_settings, EchoBackend(token_delay_ms=token_delay_ms))
        await engine.start()
        try:
            await asyncio.wait_for(engine.registered.wait(), 10)
            yield Fleet(url, coordinator, engine)
        finally:
            await engine.stop()


@pytest.fixture
async def fleet(secured_nats: EmbeddedNatsServer, caplog: pytest.LogCaptureFixture) -> AsyncIterator[Fleet]:
    url = secured_nats.url
    async with running_fleet(role_settings(url, "coordinator"), role_settings(url, "engine"), url) as running:
        yield running
    # The example config must allow everything the coordinator and engine do themselves:
    # registering, heartbeats, routing, broadcasts and their confirmations, replies.
    records = [*caplog.get_records("setup"), *caplog.get_records("call"), *caplog.records]
    refused = [
        record.getMessage()
        for record in records
        if "permissions violation" in record.getMessage()
        and ("(dpcoord-coordinator-" in record.getMessage() or "(dpcoord-engine-" in record.getMessage())
    ]
    assert refused == []


async def assert_still_running(fleet: Fleet) -> None:
    """A round trip through the coordinator, then its state: nothing paused the fleet."""
    async with await DpcoordClient.connect(role_settings(fleet.url, "client")) as client:
        final = await client.submit("still here", max_tokens=2)
    assert final.finish_reason == "length"
    assert fleet.coordinator.state is CoordinatorState.RUNNING
    assert not fleet.engine.paused
    assert len(fleet.coordinator.engines) == 1
