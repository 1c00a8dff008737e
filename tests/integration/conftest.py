"""Fixtures the integration tests share: a gateway on the test coordinator, and the official
``openai`` SDK pointed at it (a test module that needs other gateway settings defines its own
``gateway``); and, for the security tests, nats-server under docs/nats-server.example.conf with
a fleet on it (defined in tests/security_helpers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from service.coordinator.coordinator import Coordinator
from service.ops.settings import Settings
from tests.gateway_helpers import Served, serve_gateway
from tests.security_helpers import fleet, secured_nats, server_env  # noqa: F401  (fixtures)


@pytest.fixture
async def gateway(settings: Settings, coordinator: Coordinator) -> AsyncIterator[Served]:
    async with serve_gateway(settings) as served:
        yield served


@pytest.fixture
async def aclient(gateway: Served) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
    yield client
    await client.close()
